"""(f) The cost of collective fingerprints: ``MultiWorkerMirroredStrategy`` with
``CommunicationOptions(verify_collectives=True)`` (the default) against ``False``.

The training step of (c) (the tutorial CNN, Adam, global batch 128 over 2 gloo workers x 1
thread, ``strategy.run`` then a SUM ``reduce`` of the loss): per step, the checked variant
compares fingerprints before the reduce and before the optimizer step (two small
all-gathers; the gradient buckets carry their signature in both variants). Both pairs run
interleaved in one invocation (``common.measure_interleaved``); the parameters of the two
must stay bitwise equal (the checks change no number).

Run: ``python benchmarks/bench_collective_checks.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_multi_worker import MultiWorker, WorkerPair  # noqa: E402
from common import machine_line, max_abs_diff, measure_interleaved, median_ratio  # noqa: E402


class Unchecked(MultiWorker):
    verify_collectives = False


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=6, help="training steps per variant per round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="few rounds: a smoke test, not figures")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 3, 3, 2
    print("# (f) collective fingerprints: MultiWorkerMirroredStrategy, verify_collectives True vs False")
    print(f"# {machine_line()}")
    pairs: list[WorkerPair] = []
    try:
        pairs.append(WorkerPair("checked", MultiWorker))
        pairs.append(WorkerPair("unchecked", Unchecked))
        per_step = measure_interleaved(pairs, args.steps, args.rounds, args.warmup)
        params = [pair.params_all() for pair in pairs]
    finally:
        for pair in pairs:
            pair.stop()
    med = {name: statistics.median(times) for name, times in per_step.items()}
    ratio = median_ratio(per_step["unchecked"], per_step["checked"])
    for name, seconds in med.items():
        print(f"{name:>10}: {seconds * 1e3:8.3f} ms/step")
    overhead = med["checked"] / med["unchecked"] - 1
    print(f"throughput ratio checked / unchecked: {ratio:.4f} (median of per-round ratios); "
          f"median step time +{overhead * 100:.2f}% (goal <= 1%)")
    diff = max_abs_diff(params[0][0], params[1][0])
    print(f"parameters checked vs unchecked: max abs diff {diff:.1e} (0 expected)")
    return {"median_s": med, "ratio": ratio, "overhead": overhead, "param_diff": diff}


if __name__ == "__main__":
    main()
