"""Process handling shared by the tests that start worker processes.

Every worker is started in its own session, its output goes to a file, and whatever happens
the test kills it, its process group and every descendant (found through /proc, so a
launcher's children cannot escape). No pytest and no torch at import: worker scripts import
this module too (through ``mw_helpers`` and ``multiworker/fs_model``).

A Python worker the tests start themselves is forked from a zygote that imported torch once
(``tests/zygote.py``), unless its environment differs in what torch reads at import: ``import
torch`` and ``torch._dynamo`` cost about 5 s of CPU per process, most of what the suite's
hundreds of short worker processes spent on a 2-core machine. Every process a launcher
starts (torchrun, mpirun, srun, ``torch-distribute launch``, a parameter-server cluster) is a
fresh interpreter, and ``TD_TEST_FRESH_INTERPRETERS=1`` makes every worker one.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

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


def kill_tree(proc: subprocess.Popen | ForkedProcess) -> None:
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


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without torchrun's variables or TF_CONFIG, one thread each."""
    from torch_distribute.cluster.launcher import TORCHRUN_VARS  # only the tests call this

    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and k != "TF_CONFIG"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
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


# The environment variables read while torch is imported: a worker whose environment differs
# from the zygote's in one of them starts a fresh interpreter.
_READ_AT_IMPORT = ("OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "PYTORCH", "CUDA", "LD_", "PYTHON")


class ForkedProcess:
    """A worker forked by the zygote (``tests/zygote.py``), with the part of
    ``subprocess.Popen`` the tests use: ``pid``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``. The zygote is its parent and tells its exit status on ``connection``."""

    def __init__(self, connection: socket.socket, args: list[str]):
        self.args = args
        self.returncode: int | None = None
        self._connection = connection
        self._received = b""
        reply = self._line(None)
        if not reply:
            raise RuntimeError(f"the test zygote ended before starting {args}")
        self.pid = int(reply.split()[1])

    def poll(self) -> int | None:
        return self._exit_status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._exit_status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def _exit_status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            line = self._line(timeout)
            if line is not None:
                # Nothing more to read: the zygote itself is gone, and killed its workers.
                self.returncode = int(line.split()[1]) if line else -signal.SIGKILL
                self._connection.close()
        return self.returncode

    def _line(self, timeout: float | None) -> str | None:
        """The zygote's next line ("" at the end of the connection), None after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._received:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._connection], [], [], left)[0]:
                return None
            chunk = self._connection.recv(4096)
            if not chunk:
                return ""
            self._received += chunk
        line, self._received = self._received.split(b"\n", 1)
        return line.decode()


class _Zygote:
    """This process's zygote (started on first use; gone with this process)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._address = ""
        self.env: dict[str, str] = {}

    def usable_for(self, argv: list[str], env: dict[str, str]) -> bool:
        """Whether ``python -u *argv`` with ``env`` can be forked: a script, ``-c`` or ``-m``
        (no other interpreter option), and the zygote's values of what torch reads at import."""
        if os.environ.get("TD_TEST_FRESH_INTERPRETERS") == "1" or not argv:
            return False
        if argv[0] in ("-c", "-m"):
            if len(argv) < 2:
                return False
        elif argv[0].startswith("-"):
            return False
        if not self.env:
            self.env = clean_env()
        names = {k for k in (*env, *self.env) if k.startswith(_READ_AT_IMPORT)}
        return all(env.get(k) == self.env.get(k) for k in names)

    def fork(self, argv: list[str], env: dict[str, str], log: Path) -> ForkedProcess:
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(self._address)
        request = {"argv": argv, "env": env, "cwd": str(REPO), "log": str(log)}
        connection.sendall((json.dumps(request) + "\n").encode())
        return ForkedProcess(connection, [sys.executable, "-u", *argv])

    def _start(self) -> None:
        directory = tempfile.mkdtemp(prefix="td_zygote_")
        self._address = os.path.join(directory, "socket")
        log = Path(directory) / "zygote.log"
        # Loaded by its path: the workers' sys.path stays the one a fresh interpreter has.
        load = ("import importlib.util as u; "
                f"s = u.spec_from_file_location('zygote', {str(Path(__file__).with_name('zygote.py'))!r}); "
                f"m = u.module_from_spec(s); s.loader.exec_module(m); m.serve({self._address!r})")
        with open(log, "w") as out:
            self._proc = subprocess.Popen([sys.executable, "-u", "-c", load], env=self.env, cwd=REPO,
                                          stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        # The zygote ends by itself (and kills its workers) once this process is gone.
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        deadline = time.monotonic() + 120
        while "ready" not in log.read_text(errors="replace"):  # printed once it listens
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the test zygote did not start: {log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)


_zygote = _Zygote()


class Processes:
    """Python processes in their own sessions, output to files; all killed by ``kill_all``.

    A Python worker is forked from the zygote (``tests/zygote.py``: torch imported once) where
    its command line and environment allow, else started as a fresh interpreter, as launchers
    and ``TD_TEST_FRESH_INTERPRETERS=1`` always are."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen | ForkedProcess] = []
        self.logs: list[Path] = []

    def spawn(self, argv: list[str], env: dict[str, str], name: str,
              python: bool = True) -> subprocess.Popen | ForkedProcess:
        """``python -u *argv`` (``argv`` itself with ``python=False``: a launcher such as
        ``mpirun``) from the repository root, output to ``log_dir/<n>-<name>.log``."""
        log = self.log_dir / f"{len(self.procs)}-{name}.log"
        command = [sys.executable, "-u", *argv] if python else list(argv)
        with open(log, "w") as out:
            if python and _zygote.usable_for(argv, env):
                proc = _zygote.fork(list(argv), dict(env), log)
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

    def output(self, proc: subprocess.Popen | ForkedProcess) -> str:
        return self.logs[self.procs.index(proc)].read_text(errors="replace")

    def wait(self, proc: subprocess.Popen | ForkedProcess, limit: float) -> int | None:
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
