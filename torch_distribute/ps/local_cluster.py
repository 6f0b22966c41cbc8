"""Run a parameter-server job on this machine: one command starts every task.

    python -m torch_distribute.ps.local_cluster --workers 2 --ps 2 train.py --epochs 3

Each task (``chief``, ``worker`` × N, ``ps`` × M) runs the same script with its own
``TF_CONFIG`` on loopback; output lines are prefixed with the task. The job ends when the
chief exits: the other tasks are stopped (SIGTERM, then SIGKILL, to each process group) and
the chief's exit code is returned. ``restart_workers=True`` (``--restart-workers``) starts a
worker again when it dies, as a cluster manager would; it rejoins the running job.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from torch_distribute.cluster.launcher import free_ports

__all__ = ["cluster_config", "main", "run_local_cluster"]


def cluster_config(num_workers: int, num_ps: int) -> dict[str, list[str]]:
    """A loopback cluster: ``{"chief": [...], "worker": [...], "ps": [...]}`` on free ports."""
    ports = free_ports(1 + num_workers + num_ps)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    return {"chief": addresses[:1], "worker": addresses[1:1 + num_workers], "ps": addresses[1 + num_workers:]}


def _forward(pipe: IO[bytes], prefix: str, stream: IO[str], lock: threading.Lock) -> None:
    for line in iter(pipe.readline, b""):
        with lock:
            try:
                stream.write(prefix + line.decode("utf-8", errors="replace"))
                stream.flush()
            except (OSError, ValueError):
                pass
    pipe.close()


class _Task:
    def __init__(self, job: str, index: int, command: list[str], env: dict[str, str],
                 stream: IO[str], lock: threading.Lock):
        self.job, self.index = job, index
        self.proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
        for pipe in (self.proc.stdout, self.proc.stderr):  # apart: lines never interleave
            threading.Thread(target=_forward, args=(pipe, f"[{job}:{index}] ", stream, lock), daemon=True).start()

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def run_local_cluster(
    argv: Sequence[str],
    num_workers: int = 2,
    num_ps: int = 2,
    *,
    restart_workers: bool = False,
    timeout: float | None = None,
    extra_env: Mapping[str, str] | None = None,
    stdout: IO[str] | None = None,
) -> int:
    """Start every task of ``argv`` (``["train.py", ...]``); return the chief's exit code.

    ``timeout`` (seconds) stops everything and returns 124 when it passes.
    """
    stream = stdout if stdout is not None else sys.stdout
    lock = threading.Lock()
    cluster = cluster_config(num_workers, num_ps)
    base = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    base.setdefault("OMP_NUM_THREADS", "1")
    command = [sys.executable, "-u", *argv]

    def start(job: str, index: int) -> _Task:
        env = {**base, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})}
        return _Task(job, index, command, env, stream, lock)

    tasks: list[_Task] = []
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        chief = start("chief", 0)
        tasks.append(chief)
        tasks += [start("ps", i) for i in range(num_ps)]
        tasks += [start("worker", i) for i in range(num_workers)]
        while chief.proc.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                return 124
            if restart_workers:
                for k, task in enumerate(tasks):
                    if task.job == "worker" and task.proc.poll() not in (None, 0):
                        with lock:
                            stream.write(f"[local_cluster] worker:{task.index} exited "
                                         f"({task.proc.returncode}); restarting it\n")
                        tasks[k] = start("worker", task.index)
            time.sleep(0.1)
        return chief.proc.returncode
    finally:
        for task in tasks:
            if task.proc.poll() is None:
                task.signal(signal.SIGTERM)
        end = time.monotonic() + 5.0
        while time.monotonic() < end and any(t.proc.poll() is None for t in tasks):
            time.sleep(0.05)
        for task in tasks:
            task.signal(signal.SIGKILL)
            try:
                task.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torch_distribute.ps.local_cluster",
        description="Run a ParameterServerStrategy script as chief + workers + ps on this machine.")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--restart-workers", action="store_true",
                        help="start a worker again when it dies (it rejoins the job)")
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    return run_local_cluster([args.script, *args.script_args], args.workers, args.ps,
                             restart_workers=args.restart_workers, timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
