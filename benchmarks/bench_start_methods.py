"""How much a launch's start costs: ``--start-method fresh`` vs ``forkserver``.

    python benchmarks/bench_start_methods.py [--rounds 3] [--nproc 2]

Each round runs ``torch-distribute launch --nproc N`` of a script that imports torch and
steps an optimizer, once per start method, interleaved; it prints each launch's wall time and
the CPU seconds of every process it started (the launcher, its workers and the forkserver,
which this process adopts as a child subreaper to count it), then the medians. Linux only.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

JOB = "import torch\nopt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)\nopt.step()\n"
_PR_SET_CHILD_SUBREAPER = 36


def launch(script: str, method: str, nproc: int) -> tuple[float, float]:
    """One launch: its wall seconds and the CPU seconds of everything it started."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "torch_distribute.launch", "--nproc", str(nproc),
                    "--start-method", method, script], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.monotonic() - start
    while True:  # the forkserver (and multiprocessing's resource tracker) outlive the launcher
        try:
            os.wait()
        except ChildProcessError:
            break
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    found: dict[str, list[tuple[float, float]]] = {"fresh": [], "forkserver": []}
    with tempfile.TemporaryDirectory() as directory:
        script = os.path.join(directory, "job.py")
        with open(script, "w") as f:
            f.write(JOB)
        for _ in range(args.rounds):
            for method, runs in found.items():
                runs.append(launch(script, method, args.nproc))
                print(f"{method:10s} wall {runs[-1][0]:5.1f} s  cpu {runs[-1][1]:5.1f} s", flush=True)
    for method, runs in found.items():
        print(f"median {method:10s} wall {statistics.median(r[0] for r in runs):5.1f} s  "
              f"cpu {statistics.median(r[1] for r in runs):5.1f} s")


if __name__ == "__main__":
    main()
