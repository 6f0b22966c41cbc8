"""Process handling shared by the tests that start worker processes.

Every worker is started in its own session, its output goes to a file, and whatever happens
the test kills it, its process group and every descendant (found through /proc, so a
launcher's children cannot escape). No pytest and no torch at import: worker scripts import
this module too (through ``mw_helpers`` and ``multiworker/fs_model``).

A Python worker the tests start themselves is forked by this process's forkserver, which
imported torch once (the library's ``ForkserverTasks``), unless its environment differs in what
torch reads at import: ``import torch`` and ``torch._dynamo`` cost about 4 s of CPU per
process, most of what the suite's hundreds of short worker processes spent on a 2-core machine.
``torch-distribute launch`` and ``local_cluster`` run with ``start_method="forkserver"`` too
(``TD_START_METHOD``, set in ``conftest.py``), each with a forkserver of its own; torchrun,
mpirun, srun and ``create_in_process_cluster`` start fresh interpreters, and
``TD_TEST_FRESH_INTERPRETERS=1`` makes every worker one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch_distribute.cluster.forkserver_tasks import ForkedTask

REPO = Path(__file__).resolve().parents[1]


def parse_results(text: str, prefix: str) -> dict[int, dict]:
    """``{rank: payload}`` from the JSON lines starting with ``prefix`` in worker output.

    Lines may be plain or prefixed ``[rank i] `` by the launcher.
    """
    out: dict[int, dict] = {}
    for line in text.splitlines():
        if line.startswith("[rank ") and "] " in line:
            line = line.split("] ", 1)[1]
        if line.startswith(prefix):
            payload = json.loads(line[len(prefix):])
            out[payload["rank"]] = payload
    return out


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc), so nothing escapes the cleanup."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen | ForkedTask) -> None:
    """SIGKILL ``proc`` (if it still runs), its process group and every descendant; reap it.

    Works on stopped (SIGSTOP) processes too. A process that already exited is left alone:
    our worker scripts have no children, and the launcher stops its own before exiting.
    """
    if proc.poll() is None:
        for pid in [proc.pid, *descendants(proc.pid)]:
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


#: What every worker the tests start gets: one thread each, for computing and for inductor's
#: compilation (several workers share 2 cores), and unbuffered output.
WORKER_START_ENV = {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without torchrun's variables or TF_CONFIG, with
    ``WORKER_START_ENV``."""
    from torch_distribute.cluster.launcher import TORCHRUN_VARS  # only the tests call this

    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and k != "TF_CONFIG"}
    env.update(WORKER_START_ENV)
    env.update(extra)
    return env


def meet(directory: str, name: str, count: int, limit: float = 120.0) -> None:
    """Wait until ``count`` processes (``name`` differing) have called this with ``directory``,
    or ``limit`` seconds. Workers of a job call it after ``import torch``, so that one started late
    on loaded cores does not run into a short start-up timeout meant for something else."""
    with open(os.path.join(directory, f"arrived-{name}"), "w"):
        pass
    deadline = time.monotonic() + limit
    while len(os.listdir(directory)) < count and time.monotonic() < deadline:
        time.sleep(0.05)


class _Forkserver:
    """This process's forkserver (``torch_distribute/cluster/forkserver_tasks.py``, started
    on first use, gone with this process), for the workers the tests start themselves."""

    def __init__(self) -> None:
        self._tasks = None

    def get(self):
        if self._tasks is None:
            from torch_distribute.cluster.forkserver_tasks import ForkserverTasks

            self._tasks = ForkserverTasks()
        return self._tasks

    def usable_for(self, command: list[str], env: dict[str, str]) -> bool:
        return os.environ.get("TD_TEST_FRESH_INTERPRETERS") != "1" and self.get().why_not(command, env) is None


_forkserver = _Forkserver()


_forkserver_ready: list[bool] = []


def start_forkserver() -> None:
    """Start this process's forkserver now (unless it runs) with the start-up environment of
    the tests' workers (``clean_env``), not with whatever the first worker started has; and
    wait for its import of torch (a first task waits for it), so that no test's time limit
    pays for it."""
    if os.environ.get("TD_TEST_FRESH_INTERPRETERS") == "1" or _forkserver_ready:
        return
    env = clean_env()
    tasks = _forkserver.get()
    tasks.start_server(env)
    if tasks.why_not([sys.executable, "-u", "-c", "pass"], env) is None:
        with open(os.devnull, "w") as devnull:
            tasks.start([sys.executable, "-u", "-c", "pass"], env, stdout=devnull.fileno(),
                        stderr=devnull.fileno()).wait(timeout=600)
    _forkserver_ready.append(True)


class Processes:
    """Python processes in their own sessions, output to files; all killed by ``kill_all``.

    A Python worker is forked by this process's forkserver, which imported torch once (the
    library's ``ForkserverTasks``), where its command line and environment allow, else started
    fresh, as with ``TD_TEST_FRESH_INTERPRETERS=1``."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen | ForkedTask] = []
        self.logs: list[Path] = []

    def spawn(self, argv: list[str], env: dict[str, str], name: str,
              python: bool = True) -> subprocess.Popen | ForkedTask:
        """``python -u *argv`` (``argv`` itself with ``python=False``: a launcher such as
        ``mpirun``) from the repository root, output to ``log_dir/<n>-<name>.log``."""
        log = self.log_dir / f"{len(self.procs)}-{name}.log"
        command = [sys.executable, "-u", *argv] if python else list(argv)
        with open(log, "w") as out:
            if python and _forkserver.usable_for(command, env):
                proc = _forkserver.get().start(command, env, stdout=out.fileno(), stderr=out.fileno(),
                                               cwd=str(REPO))
            else:
                proc = subprocess.Popen(command, env=env, cwd=REPO,
                                        stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        self.procs.append(proc)
        self.logs.append(log)
        return proc

    def meeting_place(self) -> str:
        """A fresh directory for the workers of one job to :func:`meet` in."""
        return tempfile.mkdtemp(prefix="meet_", dir=self.log_dir)

    def output(self, proc: subprocess.Popen | ForkedTask) -> str:
        return self.logs[self.procs.index(proc)].read_text(errors="replace")

    def wait(self, proc: subprocess.Popen | ForkedTask, limit: float) -> int | None:
        """Exit status, or None if ``proc`` still runs after ``limit`` seconds."""
        try:
            return proc.wait(timeout=max(0.0, limit))
        except subprocess.TimeoutExpired:
            return None

    def kill_all(self) -> None:
        for proc in self.procs:
            kill_tree(proc)


@contextlib.contextmanager
def processes(log_dir: Path) -> Iterator[Processes]:
    """A :class:`Processes` whose every process is killed when the block ends, however."""
    procs = Processes(log_dir)
    try:
        yield procs
    finally:
        procs.kill_all()
