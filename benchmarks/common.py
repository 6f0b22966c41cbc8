"""Shared pieces of the benchmarks: the seed CNN, synthetic data, and interleaved timing.

The model is the one of TensorFlow's "custom training with tf.distribute" tutorial
(Conv32-Pool-Conv64-Pool-Dense64-Dense10 on 28x28x1 images), trained with Adam on
synthetic data made here from a fixed seed (no download).

Every variant that is compared runs in its *own* worker process (``VariantProcess``), kept
alive for the whole benchmark. The parent asks each in turn to run ``n`` steps and report
the seconds they took, round after round (A, B, C, A, B, C, ...), so that noise from other
processes hits every variant alike, and thread settings or global hooks of one variant (a
strategy installs torch hooks; replica threads change intra-op thread counts) never leak
into another. The reported figure is the median over rounds; ratios are the median of the
per-round ratios.

This module must not import ``torch_distribute``: the hand-written baselines import it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

NUM_IMAGES = 64 * 16
NUM_CLASSES = 10
SEED = 1234
REPLY_TIMEOUT_S = 300.0


# -- model and data ---------------------------------------------------------------------
def make_model(seed: int = SEED, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """The tutorial's CNN, initialised from ``seed`` (same weights for every variant).

    The parameters are created directly in ``dtype`` (no conversion after creation).
    """
    torch.manual_seed(seed)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return _make_model()
    finally:
        torch.set_default_dtype(saved)


def _make_model() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 5 * 5, 64),
        nn.ReLU(),
        nn.Linear(64, NUM_CLASSES),
    )


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def make_data(num_images: int = NUM_IMAGES, seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic 28x28x1 images whose label is learnable (a class-dependent blob plus noise)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, NUM_CLASSES, (num_images,), generator=g)
    templates = torch.rand(NUM_CLASSES, 1, 28, 28, generator=g)
    images = 0.5 * templates[labels] + 0.5 * torch.rand(num_images, 1, 28, 28, generator=g)
    return images.contiguous(), labels


def global_batches(
    batch_size: int, num_images: int = NUM_IMAGES, dtype: torch.dtype = torch.float32
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The data cut into global batches (each a tuple ``(images, labels)``)."""
    images, labels = make_data(num_images)
    return [
        (images[i : i + batch_size].to(dtype, copy=True), labels[i : i + batch_size].clone())
        for i in range(0, num_images - batch_size + 1, batch_size)
    ]


class Cycle:
    """Endless iteration over an iterable, restarting it (``iter()``) when it runs out."""

    def __init__(self, iterable: Any):
        self._iterable = iterable
        self._it = iter(iterable)

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self._iterable)
            return next(self._it)


def timed(run_steps: Callable[[int], Any], n: int) -> float:
    """Seconds taken by ``run_steps(n)``."""
    start = time.perf_counter()
    run_steps(n)
    return time.perf_counter() - start


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest elementwise difference between two sets of parameters (same names)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def relative_l2_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``||a - b|| / ||b||`` over all parameters together.

    Adam divides by the gradient's RMS, so a gradient entry that is pure float noise (a dead
    unit) moves by ~lr whatever its sign: a few elements can differ by a few lr between two
    correct runs that only sum in a different order. A wrong gradient moves almost every
    element; this measure tells the two apart.
    """
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


# -- variants in worker processes ----------------------------------------------------------
class Trainer:
    """A model, its optimizer and its data, ready to train: what ``Variant.build`` returns."""

    def __init__(self, run_steps: Callable[[int], None], model: nn.Module):
        self.run_steps = run_steps
        self.model = model

    def params(self) -> dict[str, torch.Tensor]:
        """The model's parameters (a detached CPU copy), for the correctness check."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.named_parameters()}


def handwritten_trainer(dtype: torch.dtype, global_batch: int) -> Trainer:
    """The tutorial's step written by hand in plain PyTorch on one process: the baseline."""
    import torch.nn.functional as F

    model = make_model(dtype=dtype)
    optimizer = make_optimizer(model)
    batches = Cycle(global_batches(global_batch, dtype=dtype))
    total = torch.zeros((), dtype=dtype)

    def run_steps(n: int) -> None:
        nonlocal total
        for _ in range(n):
            images, labels = next(batches)
            logits = model(images)
            loss = F.cross_entropy(logits, labels, reduction="none").sum() / global_batch
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total += loss.detach()

    return Trainer(run_steps, model)


def ddp_trainer(
    rank: int, world_size: int, dtype: torch.dtype, global_batch: int, log_global_loss: bool,
    compile: bool = False,
) -> Trainer:
    """Raw ``DistributedDataParallel``: rank ``r`` trains on its rows of every global batch.

    ``log_global_loss``: all-reduce the loss every step, as a loop that logs the global loss
    does (the strategy variants do it with ``strategy.reduce``). ``compile``: the model
    compiled, then wrapped: ``DistributedDataParallel(torch.compile(model))``. The other order,
    ``torch.compile(DistributedDataParallel(model))``, compiles no graph at all on torch 2.13
    (dynamo cannot trace DDP's forward context manager and falls back to eager for the whole
    call), which made this baseline eager DDP until 2026-11-25.
    """
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    core = make_model(dtype=dtype)
    model = DistributedDataParallel(torch.compile(core) if compile else core)
    optimizer = make_optimizer(model)
    local = global_batch // world_size
    lo, hi = rank * local, (rank + 1) * local
    batches = Cycle([(x[lo:hi], y[lo:hi]) for x, y in global_batches(global_batch, dtype=dtype)])
    total = torch.zeros((), dtype=dtype)

    def run_steps(n: int) -> None:
        nonlocal total
        for _ in range(n):
            images, labels = next(batches)
            logits = model(images)
            loss = F.cross_entropy(logits, labels)  # DDP averages the ranks' gradients
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            logged = loss.detach()
            if log_global_loss:
                logged = logged.clone()
                dist.all_reduce(logged)
                logged /= world_size
            total += logged

    return Trainer(run_steps, core)


def strategy_trainer(strategy: Any, dtype: torch.dtype, global_batch: int) -> Trainer:
    """The tutorial's step under ``strategy``: what every strategy variant times.

    Model and optimizer made in ``strategy.scope()``, global batches through
    ``experimental_distribute_dataset``, ``strategy.run`` and a SUM ``reduce`` of the loss
    every step (the global loss a training loop logs). ``torch_distribute`` is imported here so
    that baseline processes never load it.
    """
    import torch.nn.functional as F

    import torch_distribute as td

    with strategy.scope():
        model = make_model(dtype=dtype)
        optimizer = make_optimizer(model)
    batches = Cycle(strategy.experimental_distribute_dataset(global_batches(global_batch, dtype=dtype)))
    total = torch.zeros((), dtype=dtype)

    def train_step(batch):
        images, labels = batch
        logits = model(images)
        loss = td.compute_average_loss(
            F.cross_entropy(logits, labels, reduction="none"), global_batch_size=global_batch
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def run_steps(n: int) -> None:
        nonlocal total
        for _ in range(n):
            per_replica = strategy.run(train_step, args=(next(batches),))
            total += strategy.reduce("sum", per_replica, axis=None)

    return Trainer(run_steps, model)


class Variant:
    """What a worker process runs: ``build(dtype)`` makes a fresh ``Trainer``.

    The timed trainer is float32; ``reference_params`` trains a fresh float64 one (same
    init, same batches), where summation order no longer matters, for an exact check.
    """

    def build(self, dtype: torch.dtype) -> Trainer:
        raise NotImplementedError

    def setup(self) -> None:
        self.trainer = self.build(torch.float32)

    def run_steps(self, n: int) -> None:
        self.trainer.run_steps(n)

    def params(self) -> dict[str, torch.Tensor]:
        return self.trainer.params()

    def reference_params(self, steps: int) -> dict[str, torch.Tensor]:
        trainer = self.build(torch.float64)
        trainer.run_steps(steps)
        return trainer.params()

    def info(self) -> dict[str, Any]:
        return {"torch_threads": torch.get_num_threads()}

    def close(self) -> None:
        pass


def _worker(conn: Any, make_variant: Callable[..., Variant], args: tuple, num_threads: int | None) -> None:
    try:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        variant = make_variant(*args)
        variant.setup()
        conn.send(("ready", variant.info()))
        while True:
            command, value = conn.recv()
            if command == "run":
                conn.send(("ok", timed(variant.run_steps, value)))
            elif command == "params":
                conn.send(("ok", variant.params()))
            elif command == "reference_params":
                conn.send(("ok", variant.reference_params(value)))
            elif command == "stop":
                variant.close()
                conn.send(("ok", None))
                return
    except BaseException:  # noqa: BLE001 - reported to the parent
        try:
            conn.send(("error", traceback.format_exc()))
        except (BrokenPipeError, OSError):
            pass


class VariantProcess:
    """One variant in a spawned process (or a group of processes, e.g. DDP ranks)."""

    def __init__(
        self,
        name: str,
        make_variant: Callable[..., Variant],
        args_per_process: Sequence[tuple] = ((),),
        num_threads: int | None = None,
    ):
        self.name = name
        ctx = mp.get_context("spawn")
        self._conns = []
        self._procs = []
        for args in args_per_process:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, make_variant, args, num_threads), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self.info = self._replies()[0]

    def _replies(self, timeout: float = REPLY_TIMEOUT_S) -> list[Any]:
        out = []
        deadline = time.monotonic() + timeout
        for rank, conn in enumerate(self._conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.kill()
                raise TimeoutError(f"{self.name}: process {rank} did not answer within {timeout:.0f}s")
            try:
                status, value = conn.recv()
            except EOFError:
                self.kill()
                raise RuntimeError(f"{self.name}: process {rank} died") from None
            if status == "error":
                self.kill()
                raise RuntimeError(f"{self.name}: process {rank} failed:\n{value}")
            out.append(value)
        return out

    def _send(self, command: str, value: Any = None) -> None:
        for conn in self._conns:
            conn.send((command, value))

    def run(self, n: int) -> float:
        """Seconds for ``n`` steps (the slowest process of the group)."""
        self._send("run", n)
        return max(self._replies())

    def params(self) -> dict[str, torch.Tensor]:
        self._send("params")
        return self._replies()[0]

    def reference_params(self, steps: int) -> dict[str, torch.Tensor]:
        """Parameters of a fresh float64 trainer after ``steps`` steps (untimed)."""
        self._send("reference_params", steps)
        return self._replies()[0]

    def stop(self) -> None:
        try:
            self._send("stop")
            self._replies(timeout=60)
        finally:
            for proc in self._procs:
                proc.join(timeout=10)
            self.kill()

    def kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(port: int, rank: int, world_size: int) -> Any:
    """``torch.distributed`` with its default Gloo group made over loopback ``port``."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    return dist


# -- measuring -------------------------------------------------------------------------------
def measure_interleaved(
    variants: Sequence[VariantProcess], steps: int, rounds: int, warmup: int
) -> dict[str, list[float]]:
    """Seconds per step of each variant in each round, variants interleaved in every round.

    The order within a round rotates, so no variant always runs right after another.
    """
    for v in variants:
        v.run(warmup)
    per_step: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(rounds):
        order = list(variants[r % len(variants):]) + list(variants[: r % len(variants)])
        for v in order:
            per_step[v.name].append(v.run(steps) / steps)
    return per_step


def median_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """Median over rounds of ``numerator / denominator`` (same round paired)."""
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


def machine_line() -> str:
    return (
        f"torch {torch.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, {platform.machine()}, default torch threads {torch.get_num_threads()}, "
        f"load average {load_average()}"
    )


def load_average() -> str:
    """The 1-minute load average: above the CPU count, other processes skew the timings."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "n/a"


def emit(result: dict[str, Any]) -> None:
    """Print a machine-readable result line (``run_all.py`` collects these)."""
    import json

    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
