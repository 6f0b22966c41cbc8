"""Run a parameter-server job on this machine: one command starts every task.

    python -m torch_distribute.ps.local_cluster --workers 2 --ps 2 train.py --epochs 3

Each task (``chief``, ``worker`` × N, ``ps`` × M) runs the same script with its own
``TF_CONFIG`` on loopback; output lines are prefixed with the task. The job ends when the
chief exits: the other tasks are stopped (SIGTERM, then SIGKILL, to each process group) and
the chief's exit code is returned. ``restart_workers=True`` (``--restart-workers``) starts a
worker again when it dies, as a cluster manager would; it rejoins the running job. The
processes are run by :mod:`torch_distribute.cluster.supervisor` (``run_until_exit``), forked
by Python's forkserver, which imported torch once, with ``start_method="forkserver"``
(``--start-method forkserver``, ``TD_START_METHOD=forkserver``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import IO

from torch_distribute.cluster.launch_spec import free_ports
from torch_distribute.cluster.supervisor import START_METHODS, ProcessSupervisor, TaskSpec
from torch_distribute.collectives import job_secret
from torch_distribute.errors import InvalidArgumentError

__all__ = ["cluster_config", "main", "run_local_cluster"]

#: Seconds between SIGTERM and SIGKILL when the job ends.
GRACE_PERIOD_S = 5.0


def cluster_config(num_workers: int, num_ps: int) -> dict[str, list[str]]:
    """A loopback cluster: ``{"chief": [...], "worker": [...], "ps": [...]}`` on free ports.

    Raises:
        InvalidArgumentError: fewer than one worker or one parameter server.
    """
    for name, value in (("--workers", num_workers), ("--ps", num_ps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")
    ports = free_ports(1 + num_workers + num_ps)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    return {"chief": addresses[:1], "worker": addresses[1:1 + num_workers], "ps": addresses[1 + num_workers:]}


def run_local_cluster(
    argv: Sequence[str],
    num_workers: int = 2,
    num_ps: int = 2,
    *,
    restart_workers: bool = False,
    timeout: float | None = None,
    extra_env: Mapping[str, str] | None = None,
    stdout: IO[str] | None = None,
    start_method: str | None = None,
) -> int:
    """Start every task of ``argv`` (``["train.py", ...]``); return the chief's exit code.

    Both stdout and stderr of every task go to ``stdout`` (default ``sys.stdout``). The
    tasks share a fresh job secret (``TD_JOB_SECRET``) unless one is set already.
    ``timeout`` (seconds) stops everything and returns 124 when it passes.
    ``start_method``: ``"fresh"`` starts each task anew, ``"forkserver"`` forks them from
    the standard library's forkserver, which imported torch once (starts and restarts without
    torch's import; multiprocessing imports the calling program's main module in each task
    first, so guard it with ``if __name__ == "__main__":``); None reads ``TD_START_METHOD``
    (default fresh).
    """
    stream = stdout if stdout is not None else sys.stdout
    cluster = cluster_config(num_workers, num_ps)
    base = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    base.setdefault("OMP_NUM_THREADS", "1")
    if job_secret.job_secret(base) is None:  # every task of the job shares a fresh secret
        base[job_secret.ENV_SECRET] = job_secret.new_secret()
    command = [sys.executable, "-u", *argv]

    def task(job: str, index: int) -> TaskSpec:
        config = {"cluster": cluster, "task": {"type": job, "index": index}}
        return TaskSpec(name=f"{job}:{index}", prefix=f"[{job}:{index}] ", command=command,
                        env={**base, "TF_CONFIG": json.dumps(config)},
                        restartable=restart_workers and job == "worker")

    tasks = [task("chief", 0)]
    tasks += [task("ps", i) for i in range(num_ps)]
    tasks += [task("worker", i) for i in range(num_workers)]
    supervisor = ProcessSupervisor(stdout=stream, stderr=stream, grace_period=GRACE_PERIOD_S,
                                   log_prefix="[local_cluster] ", log_stream=stream,
                                   start_method=start_method)
    return supervisor.run_until_exit(tasks, leader=0, timeout=timeout)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torch_distribute.ps.local_cluster",
        description="Run a ParameterServerStrategy script as chief + workers + ps on this machine.")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--restart-workers", action="store_true",
                        help="start a worker again when it dies (it rejoins the job)")
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--start-method", choices=START_METHODS, default=None,
                        help="fresh: a new interpreter for each task; forkserver: fork the tasks "
                             "from Python's forkserver, which imported torch once (default: "
                             "$TD_START_METHOD, else fresh)")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    return run_local_cluster([args.script, *args.script_args], args.workers, args.ps,
                             restart_workers=args.restart_workers, timeout=args.timeout,
                             start_method=args.start_method)


if __name__ == "__main__":
    sys.exit(main())
