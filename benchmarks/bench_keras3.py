"""(f) Keras 3 (``KERAS_BACKEND=torch``) ``fit`` under the strategies vs ``td.keras.Model.fit``
on the same network, and vs the hand-written PyTorch loop.

The network is the benchmarks' tutorial CNN (Conv32-Pool-Conv64-Pool-Dense64-Dense10, Adam,
sparse categorical cross-entropy on logits), global batch 128, synthetic data. Each variant
runs in a process of its own, the variants one after another in a rotating order, each
process started ``--repeats`` times; every ``run_steps(n)`` is one ``fit`` call over ``n``
global batches (so ``fit``'s own per-call cost is in the figures, spread over ``n`` steps, as
in an epoch). Both wall-clock and CPU seconds (all the process's threads) per step are
reported: on a shared machine the CPU figure is the steadier one, and ``--threads 1`` keeps
OpenMP threads from spinning while their peer is descheduled (which makes a 2-thread
one-device step cost several times its CPU under load; each replica of a 2-replica strategy
runs with 1 thread).

* ``keras3``: a ``keras.Sequential`` and Keras' own ``fit``, no strategy.
* ``keras3 mirrored``: the same model made in ``td.MirroredStrategy(["cpu:0", "cpu:1"])``'s
  scope (``torch_distribute/keras3/``: each replica computes its 64 rows).
* ``td.keras``: ``td.keras.Model`` over the same network as a ``torch.nn.Sequential``.
* ``td.keras mirrored``: the same under ``td.MirroredStrategy(["cpu:0", "cpu:1"])``.
* ``hand-written``: the plain PyTorch loop on the whole batch (``common.handwritten_trainer``).

Reported: seconds per step (median over rounds and processes) and the ratios keras3 /
td.keras (time: > 1 means Keras 3 is slower), each strategy's time over its one-device time,
and each one-device ``fit`` over the hand-written loop. Run: ``python benchmarks/bench_keras3.py [--quick]``.
Needs keras (``pip install -e .[keras]``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    Trainer,
    Variant,
    emit,
    global_batches,
    handwritten_trainer,
    load_average,
    machine_line,
    make_model,
)

GLOBAL_BATCH = 128


def _arrays(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    batches = global_batches(GLOBAL_BATCH, dtype=dtype)
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])


def _fit_steps(model: Any, dtype: torch.dtype, as_numpy: bool) -> Callable[[int], None]:
    """``run_steps(n)``: one ``model.fit`` over the next ``n`` global batches of the data, in
    order, round and round (as NumPy arrays for Keras 3, tensors for td.keras)."""
    x, y = _arrays(dtype)
    per_epoch = x.shape[0] // GLOBAL_BATCH
    position = [0]

    def run_steps(n: int) -> None:
        rows = []
        for _ in range(n):
            rows.append(position[0])
            position[0] = (position[0] + 1) % per_epoch
        index = torch.cat([torch.arange(r * GLOBAL_BATCH, (r + 1) * GLOBAL_BATCH) for r in rows])
        inputs, labels = x[index], y[index]
        if as_numpy:
            inputs, labels = inputs.numpy(), labels.numpy()
        model.fit(inputs, labels, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)

    return run_steps


def _keras_model():
    import keras

    return keras.Sequential([
        keras.Input((1, 28, 28)),
        keras.layers.Conv2D(32, 3, activation="relu", data_format="channels_first"),
        keras.layers.MaxPooling2D(data_format="channels_first"),
        keras.layers.Conv2D(64, 3, activation="relu", data_format="channels_first"),
        keras.layers.MaxPooling2D(data_format="channels_first"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


class Keras3(Variant):
    def __init__(self, mirrored: bool):
        self.mirrored = mirrored

    def build(self, dtype: torch.dtype) -> Trainer:
        os.environ["KERAS_BACKEND"] = "torch"
        os.environ["KERAS_TORCH_DEVICE"] = "cpu"
        import keras

        import torch_distribute as td

        keras.config.set_floatx("float64" if dtype == torch.float64 else "float32")
        keras.utils.set_random_seed(1234)
        strategy = td.MirroredStrategy(["cpu:0", "cpu:1"]) if self.mirrored else None
        with strategy.scope() if strategy is not None else _null():
            model = _keras_model()
            model.compile(optimizer=keras.optimizers.Adam(1e-3),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return Trainer(_fit_steps(model, dtype, as_numpy=True), torch.nn.Module())


class TdKeras(Variant):
    def __init__(self, mirrored: bool):
        self.mirrored = mirrored

    def build(self, dtype: torch.dtype) -> Trainer:
        import torch_distribute as td

        strategy = td.MirroredStrategy(["cpu:0", "cpu:1"]) if self.mirrored else None
        with strategy.scope() if strategy is not None else _null():
            model = td.keras.Model(make_model(dtype=dtype))
            model.compile(optimizer=td.keras.optimizers.Adam(1e-3),
                          loss=td.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return Trainer(_fit_steps(model, dtype, as_numpy=False), model)


class HandWritten(Variant):
    def build(self, dtype: torch.dtype) -> Trainer:
        return handwritten_trainer(dtype, GLOBAL_BATCH)


def _null():
    import contextlib

    return contextlib.nullcontext()


VARIANTS = {
    "keras3": (Keras3, (False,)),
    "keras3 mirrored": (Keras3, (True,)),
    "td.keras": (TdKeras, (False,)),
    "td.keras mirrored": (TdKeras, (True,)),
    "hand-written": (HandWritten, ()),
}


def child(name: str, steps: int, rounds: int, warmup: int, threads: int | None) -> None:
    """One variant in this process: ``rounds`` timings of ``steps`` steps after ``warmup``,
    wall-clock and CPU (every thread of the process) seconds per step."""
    import time

    if threads:
        torch.set_num_threads(threads)
    make, args = VARIANTS[name]
    variant = make(*args)
    variant.setup()
    variant.run_steps(warmup)
    wall, cpu = [], []
    for _ in range(rounds):
        w, c = time.perf_counter(), time.process_time()
        variant.run_steps(steps)
        wall.append((time.perf_counter() - w) / steps)
        cpu.append((time.process_time() - c) / steps)
    print("CHILD " + json.dumps({"wall": wall, "cpu": cpu}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="each variant's process, started this often")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 4 steps, one process per variant")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads of every variant (default: torch's). On a loaded "
                             "machine 1 avoids OpenMP threads spinning while their peer is descheduled")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup, args.repeats = 3, 4, 4, 1
    if args.variant:
        child(args.variant, args.steps, args.rounds, args.warmup, args.threads)
        return
    wall: dict[str, list[float]] = {name: [] for name in VARIANTS}
    cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for repeat in range(args.repeats):  # variants one after another, in a rotating order
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            threads = ["--threads", str(args.threads)] if args.threads else []
            done = subprocess.run([sys.executable, __file__, "--variant", name, "--steps", str(args.steps),
                                   "--rounds", str(args.rounds), "--warmup", str(args.warmup), *threads],
                                  capture_output=True, text=True, timeout=1800)
            lines = [line for line in done.stdout.splitlines() if line.startswith("CHILD ")]
            if done.returncode != 0 or not lines:
                raise SystemExit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
            measured = json.loads(lines[-1][len("CHILD "):])
            wall[name] += measured["wall"]
            cpu[name] += measured["cpu"]
    seconds = {name: {"wall": statistics.median(wall[name]), "cpu": statistics.median(cpu[name])} for name in VARIANTS}
    pairs = {
        "keras3 / td.keras (one device)": ("keras3", "td.keras"),
        "keras3 / td.keras (mirrored)": ("keras3 mirrored", "td.keras mirrored"),
        "keras3 mirrored / keras3": ("keras3 mirrored", "keras3"),
        "td.keras mirrored / td.keras": ("td.keras mirrored", "td.keras"),
        "keras3 / hand-written": ("keras3", "hand-written"),
        "td.keras / hand-written": ("td.keras", "hand-written"),
    }
    ratios = {label: {kind: seconds[a][kind] / seconds[b][kind] for kind in ("wall", "cpu")}
              for label, (a, b) in pairs.items()}
    print(machine_line(), "load:", load_average(), "threads:", args.threads or "torch's default")
    for name, value in seconds.items():
        print(f"{name:>20}: {value['wall'] * 1000:8.1f} ms/step wall, {value['cpu'] * 1000:8.1f} ms/step CPU")
    for label, value in ratios.items():
        print(f"{label:>32}: {value['wall']:.2f}x wall, {value['cpu']:.2f}x CPU (time: > 1 is slower)")
    emit({"benchmark": "keras3", "global_batch": GLOBAL_BATCH, "seconds_per_step": seconds, "time_ratios": ratios,
          "load": load_average()})


if __name__ == "__main__":
    main()
