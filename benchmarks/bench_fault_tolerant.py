"""Per-step fault tolerance (``td.experimental.FaultTolerance``) on 3 CPU workers: what it
costs without failures, and what a failure costs, against a whole-job restart.

Every job is ``torch-distribute launch --nproc 3`` of ``ft_bench_job.py``: the tutorial CNN
with Adam, global batch 96 (32 rows per worker), one intra-op thread per worker, gloo on
loopback, 4 epochs of 10 steps.

1. Per-step overhead, no failure: ``MultiWorkerMirroredStrategy()`` vs
   ``MultiWorkerMirroredStrategy(fault_tolerance=FaultTolerance(...))`` (``--min-workers
   2``), alternating jobs (plain, ft, plain, ft, ...); the median step time of worker 0
   (reading the step's batch, which under fault tolerance makes the step's quorum, and
   ``strategy.run``) over every step but each job's first epoch (warm-up, and the first
   quorum), and the median over jobs of ft / plain (goal: <= 1.03).
2. Time lost to one failure: worker 1 SIGKILLs itself at step 15.

   * ``ft``: the launcher replaces it alone; the other two go on. Lost: the time from the
     launch to worker 0's last step, minus the same without a failure, and the survivors'
     longest gap between two steps (goal: <= 1 step + 10 s).
   * ``restart``: the plain strategy with ``td.BackupAndRestore`` every 10 steps and
     ``--max-restarts 1``: the launcher stops every worker and starts them all again, and
     they resume from the last backup. Lost: the time from the launch to worker 0's last
     step, minus the same job's without a failure (with its backups).

   Every job starts its interpreters fresh (``--start-method fresh``), as a real cluster
   does: a replacement, or a restarted job, pays for importing torch.

Numbers from a shared machine are noisy: quote them as measured under load. Run:
``python benchmarks/bench_fault_tolerant.py [--quick]``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from torch_distribute.cluster.launcher import launch  # noqa: E402

JOB = os.path.join(HERE, "ft_bench_job.py")
KILL_AT = 15


def run_job(mode: str, *args: str, restarts: int = 0) -> dict:
    """One launch; its wall time and worker 0's steps (wall clock, seconds, step)."""
    out = io.StringIO()
    start = time.time()
    ft = mode == "ft"
    code = launch([JOB, "--mode", "ft" if ft else "plain", *args], nproc=3, min_workers=2 if ft else None,
                  max_restarts=None if ft else restarts, grace_period=3, timeout=600, stdout=out, stderr=out, start_method="fresh",
                  extra_env={"OMP_NUM_THREADS": "1"})
    if code != 0:
        raise SystemExit(f"{mode} job failed ({code}):\n{out.getvalue()[-4000:]}")
    steps: dict[int, list[tuple[float, float, int]]] = {}
    done = 0.0
    for line in out.getvalue().splitlines():
        if line.startswith("[rank ") and "BENCHSTEP" in line:
            rank = int(line[6:line.index("]")])
            _, clock, seconds, step = line.split("] ", 1)[1].split()
            steps.setdefault(rank, []).append((float(clock), float(seconds), int(step)))
        elif line.startswith("[rank 0] BENCHDONE "):
            done = float(line.split()[-1])
    # From the launch to worker 0's last step: what a worker that was not lost waited for.
    return {"wall": done - start, "steps": steps}


def median_step(job: dict, skip: int) -> float:
    return statistics.median(seconds for _, seconds, step in job["steps"][0] if step > skip)


def longest_gap(job: dict) -> float:
    """The longest wait between two steps of a worker that was not killed (ranks 0 and 2)."""
    gaps = []
    for rank in (0, 2):
        clocks = [clock for clock, _, _ in job["steps"][rank]]
        gaps += [b - a for a, b in zip(clocks, clocks[1:], strict=False)]
    return max(gaps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    epochs = ["--epochs", "3" if args.quick else "4"]

    # 1. overhead
    plain, ft = [], []
    for _ in range(rounds):
        plain.append(run_job("plain", *epochs))
        ft.append(run_job("ft", *epochs))
    plain_step = [median_step(job, 10) for job in plain]
    ft_step = [median_step(job, 10) for job in ft]
    ratio = statistics.median(f / p for f, p in zip(ft_step, plain_step, strict=True))

    # 2. a failure
    with tempfile.TemporaryDirectory() as directory:
        restart_clean = run_job("plain", *epochs, "--backup-dir", os.path.join(directory, "clean"))
        restart_fail = run_job("plain", *epochs, "--backup-dir", os.path.join(directory, "fail"),
                               "--kill-at", str(KILL_AT), restarts=1)
    ft_fail = run_job("ft", *epochs, "--kill-at", str(KILL_AT))
    ft_clean_wall = statistics.median(job["wall"] for job in ft)
    result = {
        "plain_s_per_step": statistics.median(plain_step), "ft_s_per_step": statistics.median(ft_step),
        "overhead_ratio": ratio, "rounds": rounds,
        "ft_lost_s": ft_fail["wall"] - ft_clean_wall, "ft_longest_gap_s": longest_gap(ft_fail),
        "restart_lost_s": restart_fail["wall"] - restart_clean["wall"],
        "ft_clean_wall_s": ft_clean_wall, "ft_fail_wall_s": ft_fail["wall"],
        "restart_clean_wall_s": restart_clean["wall"], "restart_fail_wall_s": restart_fail["wall"],
        "load_average": os.getloadavg()[0],
    }
    step_ms = result["ft_s_per_step"] * 1e3
    print(f"per-step, no failure: plain {result['plain_s_per_step'] * 1e3:.1f} ms, fault-tolerant {step_ms:.1f} ms "
          f"(ratio {ratio:.3f}, goal <= 1.03; median over {rounds} job pairs)")
    print(f"one SIGKILL at step {KILL_AT}: fault-tolerant job lost {result['ft_lost_s']:.1f} s (survivors' longest "
          f"stall {result['ft_longest_gap_s']:.2f} s; goal <= 1 step + 10 s); whole-job restart from a backup every "
          f"10 steps lost {result['restart_lost_s']:.1f} s (load average {result['load_average']:.1f})")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
