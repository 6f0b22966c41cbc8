"""(a) The seed CNN step under ``td.OneDeviceStrategy("cpu")`` vs the same step hand-written.

Both variants train the tutorial CNN with Adam on the same synthetic global batches of 64,
from the same initial weights, each in its own process with the default torch threads:

* ``hand-written``: plain PyTorch, ``loss = cross_entropy(..., reduction="none").sum() / G``,
  backward, ``optimizer.step()``, ``optimizer.zero_grad()``; never imports torch_distribute.
* ``OneDeviceStrategy``: model and optimizer made in ``strategy.scope()``, batches through
  ``strategy.experimental_distribute_dataset``, ``strategy.run(train_step, args=(batch,))``
  with ``td.compute_average_loss``, and ``strategy.reduce("sum", ..., axis=None)``.

Reported: seconds per step of each (median over interleaved rounds) and the ratio
ours / hand-written (goal <= 1.01). After timing, the parameters of the two must be
bitwise equal (same init, same batches, same kernels).

Run: ``python benchmarks/bench_one_device.py [--rounds R --steps N --warmup W]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    Trainer,
    Variant,
    VariantProcess,
    emit,
    handwritten_trainer,
    machine_line,
    max_abs_diff,
    measure_interleaved,
    median_ratio,
    strategy_trainer,
)

GLOBAL_BATCH = 64


class HandWritten(Variant):
    def build(self, dtype: torch.dtype) -> Trainer:
        return handwritten_trainer(dtype, GLOBAL_BATCH)


class OneDevice(Variant):
    def build(self, dtype: torch.dtype) -> Trainer:
        import torch_distribute as td

        return strategy_trainer(td.OneDeviceStrategy("cpu"), dtype, GLOBAL_BATCH)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20, help="steps per variant per round")
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args(argv)

    print(f"# (a) OneDeviceStrategy vs hand-written, global batch {GLOBAL_BATCH}")
    print(f"# {machine_line()}")
    hand = VariantProcess("hand-written", HandWritten)
    ours = VariantProcess("OneDeviceStrategy", OneDevice)
    try:
        per_step = measure_interleaved([hand, ours], args.steps, args.rounds, args.warmup)
        diff = max_abs_diff(hand.params(), ours.params())
    finally:
        hand.stop()
        ours.stop()

    hand_s = statistics.median(per_step["hand-written"])
    ours_s = statistics.median(per_step["OneDeviceStrategy"])
    ratio = median_ratio(per_step["OneDeviceStrategy"], per_step["hand-written"])
    for name, times in per_step.items():
        print(f"{name:>20}: {statistics.median(times) * 1e3:8.3f} ms/step  "
              f"(rounds: {', '.join(f'{t * 1e3:.2f}' for t in times)})")
    print(f"ratio ours / hand-written (time per step, median of per-round ratios): {ratio:.4f}  (goal <= 1.01)")
    print(f"max |param diff| after {args.warmup + args.rounds * args.steps} steps: {diff:.3e}")
    result = {
        "bench": "one_device",
        "global_batch": GLOBAL_BATCH,
        "hand_s_per_step": hand_s,
        "ours_s_per_step": ours_s,
        "ratio_time_ours_over_hand": ratio,
        "param_max_abs_diff": diff,
        "rounds": args.rounds,
        "steps": args.steps,
    }
    emit(result)
    if diff != 0.0:
        print("ERROR: OneDeviceStrategy did not train exactly like the hand-written loop", file=sys.stderr)
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
