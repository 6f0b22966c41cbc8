"""(m) Cold start of local workers that compile the same ``td.function`` step: 1, 2 and 4 workers.

Each job is ``python -m torch_distribute.launch --nproc N`` of this script in ``--worker``
mode, on a fresh, empty inductor cache directory (``TORCHINDUCTOR_CACHE_DIR``; the
precompiled headers inductor keeps under its default directory are left alone, as they are
for every job), with ``OMP_NUM_THREADS=1`` in every worker (the launcher sets it for N > 1;
set for N = 1 too, so that every job runs the same single-threaded workers;
``--launcher-threads`` leaves it to the launcher: torch's default, 2 threads here, for N = 1). Each worker
makes a ``MultiWorkerMirroredStrategy`` (one CPU replica per worker, Gloo), the tutorial CNN
and Adam in its scope, and runs the distributed step under ``@td.function`` on global
batches of 64: the first call compiles, a second call checks that nothing compiles again.
The optimizer's update runs eagerly in every job (``torch.compiler.disable``): with one
worker the strategy does not route ``optimizer.step()`` and dynamo would compile Adam's
update as one more graph, which N workers (whose step the strategy routes) never compile;
so every job compiles the same graphs.

Variants: ``once`` (the default: workers on one host compile each graph once, see
``torch_distribute/compile_once.py``) and ``each`` (``TD_COMPILE_ONCE=0``: every worker
compiles its own, as before). Rounds are interleaved (every variant and worker count in
turn), and each job starts from its own empty cache.

Reported per (variant, N), medians over the rounds:

* CPU s to the first step: the sum over the workers of each one's CPU time (its threads and
  the children it waited for: the C++ compilers and inductor's probes) when its first step
  returned, plus, with ``--start-method forkserver``, the forkserver's (the imports it made
  once for all the workers); and the ratio to one worker's (same variant, same round): the
  goal is <= 1.6 for 4 workers (before: 2.19);
* wall s to the first step: from the launch to the last worker's first step returning, and
  its ratio to one worker's;
* job CPU s: the whole job (launcher, workers, to their exit), from this process's
  ``RUSAGE_CHILDREN`` (only processes waited for: not a forkserver's workers);
* per worker: the CPU at the first step, and what inductor's caches did (FX-graph cache hits
  and misses, AOTAutograd's).

Equivalence (checked, not timed): every worker prints a checksum of its parameters after
the two steps. The workers of a job must agree bitwise, and so must the ``once`` and ``each``
jobs of the same worker count (what a worker loads from the cache is what it would have
built); jobs with different worker counts sum the gradient in another order, so they only
agree closely (the largest relative difference is printed).

Run: ``python benchmarks/bench_compile_once.py [--workers 1,2,4] [--rounds 3] [--variants once,each]``
(about 6 jobs of 20-60 s per round on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
RESULT = "COMPILEONCE "
GLOBAL_BATCH = 64
VARIANTS = {"once": "1", "each": "0"}  # TD_COMPILE_ONCE
JOB_TIMEOUT_S = 600


def _cpu_seconds() -> float:
    """This process's CPU time and its children's that it waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _server_cpu_seconds() -> float:
    """Under ``--start-method forkserver``, the CPU the forkserver (this worker's parent) has
    spent so far: the imports it made once for every worker, which no worker's own time holds."""
    if os.environ.get("BENCH_START_METHOD") != "forkserver":
        return 0.0
    with open(f"/proc/{os.getppid()}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


# -- a worker, started by the launcher -------------------------------------------------------
def worker() -> None:
    import torch
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    sys.path.insert(0, os.path.dirname(HERE))
    from common import global_batches, make_model, make_optimizer

    import torch_distribute as td

    strategy = td.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = make_model()
        optimizer = make_optimizer(model)

    @torch.compiler.disable
    def update() -> None:  # eager in every job: see the module docstring
        optimizer.step()
        optimizer.zero_grad()

    def train_step(batch: Any) -> torch.Tensor:
        images, labels = batch
        loss = td.compute_average_loss(F.cross_entropy(model(images), labels, reduction="none"),
                                       global_batch_size=GLOBAL_BATCH)
        loss.backward()
        update()
        return loss

    @td.function
    def distributed_step(batch: Any) -> torch.Tensor:
        return strategy.reduce("sum", strategy.run(train_step, args=(batch,)), axis=None)

    batches = iter(strategy.experimental_distribute_dataset(global_batches(GLOBAL_BATCH)))
    first_batch, second_batch = next(batches), next(batches)
    before = time.time()
    distributed_step(first_batch)
    first_step_at = time.time()
    cpu_at_first_step = _cpu_seconds()
    server_cpu = _server_cpu_seconds()
    graphs = distributed_step.experimental_get_tracing_count()
    loss = distributed_step(second_batch)
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    caches = {f"{kind} {what}": int(counters[group][f"{prefix}_{what}"])
              for group, prefix, kind in (("inductor", "fxgraph_cache", "fx"), ("aot_autograd", "autograd_cache", "aot"))
              for what in ("hit", "miss", "bypass")}
    print(RESULT + json.dumps({
        "rank": strategy.cluster_resolver.task_id if hasattr(strategy, "cluster_resolver") else None,
        "first_step_wall_s": first_step_at - float(os.environ["BENCH_LAUNCHED_AT"]),
        "first_call_s": first_step_at - before,
        "cpu_at_first_step_s": cpu_at_first_step,
        "server": [os.getppid(), server_cpu],
        "graphs": graphs,
        "graphs_after_second_step": distributed_step.experimental_get_tracing_count(),
        "caches": caches,
        "loss": float(loss),
        "checksum": checksum,
    }), flush=True)


# -- the parent: jobs, rounds, medians ---------------------------------------------------------
def run_job(workers: int, variant: str, launcher_threads: bool = False, start_method: str = "fresh") -> dict[str, Any]:
    cache = tempfile.mkdtemp(prefix="td-bench-inductor-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TD_COMPILE_ONCE=VARIANTS[variant], OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    if launcher_threads:
        env.pop("OMP_NUM_THREADS")
    command = [sys.executable, "-m", "torch_distribute.launch", "--nproc", str(workers),
               "--start-method", start_method, "--timeout", str(JOB_TIMEOUT_S - 30), HERE, "--worker"]
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env["BENCH_LAUNCHED_AT"] = repr(time.time())
    env["BENCH_START_METHOD"] = start_method
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = [json.loads(line.split(RESULT, 1)[1]) for line in done.stdout.splitlines() if RESULT in line]
    if done.returncode != 0 or len(lines) != workers:
        return {"status": f"failed (exit {done.returncode}, {len(lines)} of {workers} results)",
                "tail": (done.stdout[-1500:] + done.stderr[-1500:])}
    return {
        "status": "ok",
        "job_s": time.monotonic() - started,
        "job_cpu_s": (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime),
        # the workers' own CPU, and a forkserver's once (the most any of its workers saw)
        "cpu_to_first_step_s": sum(w["cpu_at_first_step_s"] for w in lines)
        + sum(max(w["server"][1] for w in lines if w["server"][0] == pid) for pid in {w["server"][0] for w in lines}),
        "wall_to_first_step_s": max(w["first_step_wall_s"] for w in lines),
        "workers": lines,
    }


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,4", help="comma-separated worker counts (1 is the reference)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="once,each", help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--launcher-threads", action="store_true",
                        help="leave OMP_NUM_THREADS to the launcher (torch's default for one worker)")
    parser.add_argument("--start-method", default="fresh", choices=("fresh", "forkserver"),
                        help="how the launcher starts the workers (forkserver: forked from the standard "
                             "library's forkserver, which imported torch once: its CPU is in the job's)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker()
        return
    counts = sorted({int(n) for n in args.workers.split(",") if n} | {1})
    variants = [v for v in args.variants.split(",") if v]
    if set(variants) - set(VARIANTS) or args.rounds < 1:
        parser.error(f"--variants takes some of {', '.join(VARIANTS)}; --rounds >= 1")
    sys.path.insert(0, os.path.dirname(HERE))
    from common import load_average, machine_line

    print(f"# {machine_line()}; global batch {GLOBAL_BATCH}, tutorial CNN, Adam, MultiWorkerMirroredStrategy, "
          f"one CPU replica per worker, "
          f"{'OMP_NUM_THREADS as the launcher sets it' if args.launcher_threads else 'OMP_NUM_THREADS=1'}, "
          f"fresh inductor cache per job, workers started {args.start_method}, {args.rounds} rounds",
          flush=True)
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {(v, n): [] for v in variants for n in counts}
    checksums: dict[int, set[float]] = {n: set() for n in counts}
    for round_index in range(args.rounds):
        for variant in variants:
            for workers in counts:
                result = run_job(workers, variant, args.launcher_threads, args.start_method)
                runs[variant, workers].append(result)
                if result["status"] != "ok":
                    print(f"round {round_index + 1} {variant} x{workers}: {result['status']}\n{result['tail']}", flush=True)
                    continue
                checksums[workers] |= {w["checksum"] for w in result["workers"]}
                print(f"round {round_index + 1} {variant} x{workers}: CPU to first step "
                      f"{result['cpu_to_first_step_s']:.1f} s, wall {result['wall_to_first_step_s']:.1f} s, "
                      f"per worker {[round(w['cpu_at_first_step_s'], 1) for w in result['workers']]} s, "
                      f"load {load_average()}", flush=True)

    print("\n| variant | workers | CPU s to first step | ratio vs 1 worker | wall s to first step | ratio vs 1 worker "
          "| job CPU s | ratio vs 1 worker | graphs | per worker: CPU s at first step; caches (median round) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    summary: dict[str, Any] = {}
    for variant in variants:
        for workers in counts:
            results = runs[variant, workers]
            ok = [(i, r) for i, r in enumerate(results) if r["status"] == "ok"]
            if not ok:
                print(f"| {variant} | {workers} | failed | | | | | | | |")
                continue
            refs = runs[variant, 1]
            cpu_ratios = [r["cpu_to_first_step_s"] / refs[i]["cpu_to_first_step_s"]
                          for i, r in ok if refs[i]["status"] == "ok"]
            wall_ratios = [r["wall_to_first_step_s"] / refs[i]["wall_to_first_step_s"]
                           for i, r in ok if refs[i]["status"] == "ok"]
            job_ratios = [r["job_cpu_s"] / refs[i]["job_cpu_s"] for i, r in ok if refs[i]["status"] == "ok"]
            cpu = _median([r["cpu_to_first_step_s"] for _, r in ok])
            wall = _median([r["wall_to_first_step_s"] for _, r in ok])
            middle = sorted(ok, key=lambda pair: pair[1]["cpu_to_first_step_s"])[len(ok) // 2][1]
            per_worker = "; ".join(
                f"{w['cpu_at_first_step_s']:.1f} s, " + ", ".join(f"{k} {v}" for k, v in w["caches"].items() if v)
                for w in middle["workers"])
            graphs = sorted({(w["graphs"], w["graphs_after_second_step"]) for w in middle["workers"]})
            print(f"| {variant} | {workers} | {cpu:.1f} | {_median(cpu_ratios):.2f} | {wall:.1f} | "
                  f"{_median(wall_ratios):.2f} | {_median([r['job_cpu_s'] for _, r in ok]):.1f} | "
                  f"{_median(job_ratios):.2f} | "
                  f"{', '.join(f'{a} (then {b})' for a, b in graphs)} | {per_worker} |")
            summary[f"{variant} x{workers}"] = {
                "cpu_to_first_step_s": cpu, "cpu_ratio_vs_1": _median(cpu_ratios),
                "wall_to_first_step_s": wall, "wall_ratio_vs_1": _median(wall_ratios),
                "job_cpu_ratio_vs_1": _median(job_ratios),
                "rounds": [r["cpu_to_first_step_s"] if r["status"] == "ok" else None for r in results]}
    checksums_ok = all(len(sums) <= 1 for sums in checksums.values())
    every = [c for sums in checksums.values() for c in sums]
    spread = (max(every) - min(every)) / abs(min(every)) if every and min(every) else 0.0
    print("\nparameters after two steps (checksums): "
          + ("bitwise equal in every worker of every job with the same worker count" if checksums_ok
             else f"DIFFERENT within a worker count: {checksums}")
          + f"; largest relative difference between worker counts {spread:.1e}")
    print(RESULT + json.dumps({"summary": summary, "checksums_equal": checksums_ok}))


if __name__ == "__main__":
    main()
