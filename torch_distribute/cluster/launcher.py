"""The local launcher: ``torch-distribute launch`` / ``python -m torch_distribute.launch``.

Starts ``--nproc`` worker processes of a training script on this machine with the
environment a strategy reads (torchrun's variable names, or a ``TF_CONFIG`` per process),
prefixes each worker's output lines with its rank, and supervises the workers: when one
fails, the others are stopped (SIGTERM to each worker's process group, then SIGKILL after
the grace period) and either all local workers are started again (``--max-restarts``) or
the launcher exits non-zero naming the failed worker.

    torch-distribute launch --nproc 2 train.py --epochs 3
    torch-distribute launch --nproc 4 --nnodes 2 --node-rank 0 --master node0:29500 train.py
    torch-distribute launch --nproc 2 --env tf_config -m mypackage.train

The launcher does no networking of its own: the rendezvous is ``torch.distributed``'s
(worker 0 hosts the c10d store at ``MASTER_ADDR:MASTER_PORT``). Ports for a single-node
job are picked by binding port 0, fresh for every restart attempt.

Environment of local worker ``i`` (``--env torchrun``, the default)::

    RANK = node_rank * nproc + i     WORLD_SIZE = nnodes * nproc
    LOCAL_RANK = i                   LOCAL_WORLD_SIZE = nproc
    GROUP_RANK = node_rank           GROUP_WORLD_SIZE = nnodes
    MASTER_ADDR, MASTER_PORT         TD_RESTART_COUNT, TD_MAX_RESTARTS
    PYTHONUNBUFFERED = 1             OMP_NUM_THREADS = 1 (only if unset and nproc > 1)

With ``--env tf_config`` (one node only) the torchrun variables are replaced by
``TF_CONFIG = {"cluster": {"worker": ["127.0.0.1:p0", ...]}, "task": {"type": "worker",
"index": i}}``. An inherited ``TF_CONFIG`` is removed in torchrun mode (it would take
precedence in the strategy's resolution order) and inherited torchrun variables are
removed in tf_config mode.

Exit status: 0 when every worker exits 0; the failed worker's exit code (128 + signal
number when it was killed by a signal) once restarts are exhausted; 130/143 when the
launcher itself is interrupted (SIGINT/SIGTERM); 124 when the ``timeout`` passes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from torch_distribute.errors import InvalidArgumentError

__all__ = ["launch", "main", "worker_environments", "parse_master", "free_ports"]

PROG = "torch-distribute launch"
ENV_MODES = ("torchrun", "tf_config")

# Variables the launcher owns in torchrun mode; removed from the inherited environment in
# tf_config mode so the strategy does not mistake the job for a torchrun job.
TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)

EXIT_TIMEOUT = 124
_POLL_S = 0.05
_KILL_WAIT_S = 5.0
_READER_JOIN_S = 2.0


# ----------------------------------------------------------------------------- helpers


def _log(stream: IO[str], message: str) -> None:
    try:
        stream.write(f"{PROG}: {message}\n")
        stream.flush()
    except (OSError, ValueError):
        pass


def parse_master(master: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6addr]:port"``) → ``(host, port)``; clear error otherwise."""
    text = master.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text:
        raise InvalidArgumentError(f"--master must be HOST:PORT (got {master!r})")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise InvalidArgumentError(
            f"--master port must be an integer (got {port_text!r} in {master!r})"
        ) from None
    if not 0 < port < 65536:
        raise InvalidArgumentError(f"--master port must be in 1..65535 (got {port})")
    return host, port


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that were free on ``host`` a moment ago (bind to port 0).

    All sockets are held open until every port is picked, so the ports are distinct. There
    is an unavoidable window between closing them and a worker binding one (as in torchrun).
    """
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _validate(
    argv: Sequence[str],
    nproc: int,
    nnodes: int,
    node_rank: int,
    master: str | None,
    max_restarts: int,
    env_mode: str,
    grace_period: float,
    timeout: float | None,
) -> None:
    if isinstance(argv, str):
        raise InvalidArgumentError("the command must be a list such as ['train.py', '--lr', '0.1']")
    if not argv:
        raise InvalidArgumentError("no script given: expected `script.py [args...]` or `-m module`")
    if argv[0] == "-m":
        if len(argv) < 2 or not argv[1] or argv[1].startswith("-"):
            raise InvalidArgumentError("-m needs a module name, e.g. `-m mypackage.train`")
    elif not os.path.exists(argv[0]):
        raise InvalidArgumentError(f"script not found: {argv[0]!r} (cwd {os.getcwd()})")
    for name, value in (("nproc", nproc), ("nnodes", nnodes), ("node_rank", node_rank),
                        ("max_restarts", max_restarts)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentError(f"{name} must be an integer (got {value!r})")
    if nproc < 1:
        raise InvalidArgumentError(f"--nproc must be >= 1 (got {nproc})")
    if nnodes < 1:
        raise InvalidArgumentError(f"--nnodes must be >= 1 (got {nnodes})")
    if not 0 <= node_rank < nnodes:
        raise InvalidArgumentError(
            f"--node-rank must be in 0..{nnodes - 1} for --nnodes {nnodes} (got {node_rank})"
        )
    if nnodes > 1 and not master:
        raise InvalidArgumentError(
            f"--master HOST:PORT is required with --nnodes {nnodes} (the address of node 0, "
            "where rank 0 hosts the rendezvous store)"
        )
    if master:
        parse_master(master)
    if max_restarts < 0:
        raise InvalidArgumentError(f"--max-restarts must be >= 0 (got {max_restarts})")
    if env_mode not in ENV_MODES:
        raise InvalidArgumentError(f"--env must be one of {', '.join(ENV_MODES)} (got {env_mode!r})")
    if env_mode == "tf_config" and nnodes > 1:
        raise InvalidArgumentError(
            "--env tf_config works on one node only; for several nodes use --env torchrun or "
            "write a TF_CONFIG per process yourself"
        )
    if not grace_period >= 0:
        raise InvalidArgumentError(f"--grace-period must be >= 0 seconds (got {grace_period})")
    if timeout is not None and not timeout > 0:
        raise InvalidArgumentError(f"timeout must be > 0 seconds (got {timeout})")


def worker_environments(
    nproc: int,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    master: str | None = None,
    env_mode: str = "torchrun",
    restart_count: int = 0,
    max_restarts: int = 0,
) -> list[dict[str, str]]:
    """The variables the launcher sets for each local worker (one dict per local rank).

    Picks fresh free ports when no ``master`` is given, so every call (every restart
    attempt) gets a new rendezvous port.
    """
    common = {
        "TD_RESTART_COUNT": str(restart_count),
        "TD_MAX_RESTARTS": str(max_restarts),
        "PYTHONUNBUFFERED": "1",
    }
    if env_mode == "tf_config":
        ports = free_ports(nproc)
        workers = [f"127.0.0.1:{p}" for p in ports]
        return [
            {
                **common,
                "TF_CONFIG": json.dumps(
                    {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}
                ),
            }
            for i in range(nproc)
        ]
    if master:
        addr, port = parse_master(master)
    else:
        addr, port = "127.0.0.1", free_ports(1)[0]
    world = nnodes * nproc
    return [
        {
            **common,
            "RANK": str(node_rank * nproc + i),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(i),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": str(node_rank),
            "GROUP_WORLD_SIZE": str(nnodes),
            "ROLE_RANK": str(node_rank * nproc + i),
            "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(port),
        }
        for i in range(nproc)
    ]


def _describe_status(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by signal {name}"
    return f"failed with exit code {code}"


def _exit_code_for(code: int) -> int:
    """A worker's status as a launcher exit code: itself, or 128 + signal number."""
    return 128 - code if code < 0 else code


# ----------------------------------------------------------------------------- workers


@dataclass
class _Worker:
    rank: int
    local_rank: int
    proc: subprocess.Popen
    readers: list[threading.Thread] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid


def _forward(pipe: IO[bytes], prefix: str, stream: IO[str], lock: threading.Lock) -> None:
    """Copy ``pipe`` to ``stream`` line by line, each line prefixed; never blocks the child."""
    try:
        while True:
            line = pipe.readline(1 << 20)
            if not line:
                break
            text = line.decode("utf-8", errors="replace")
            if not text.endswith("\n"):
                text += "\n"
            with lock:
                try:
                    stream.write(prefix + text)
                    stream.flush()
                except (OSError, ValueError):
                    pass  # our own output went away (closed pipe): keep draining the child
    except (OSError, ValueError):
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def _signal_group(worker: _Worker, sig: int) -> None:
    """Send ``sig`` to the worker's process group (itself and any grandchildren)."""
    if hasattr(os, "killpg"):
        try:
            os.killpg(worker.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        return
    if worker.proc.poll() is None:  # pragma: no cover - no process groups (Windows)
        try:
            worker.proc.kill() if sig == getattr(signal, "SIGKILL", None) else worker.proc.terminate()
        except OSError:
            pass


def _group_alive(worker: _Worker) -> bool:
    if worker.proc.poll() is None:
        return True
    if not hasattr(os, "killpg"):  # pragma: no cover
        return False
    try:
        os.killpg(worker.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Supervisor:
    def __init__(
        self,
        command: list[str],
        *,
        nproc: int,
        nnodes: int,
        node_rank: int,
        master: str | None,
        max_restarts: int,
        env_mode: str,
        extra_env: Mapping[str, str] | None,
        grace_period: float,
        timeout: float | None,
        stdout: IO[str],
        stderr: IO[str],
    ) -> None:
        self.command = command
        self.nproc = nproc
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.master = master
        self.max_restarts = max_restarts
        self.env_mode = env_mode
        self.extra_env = dict(extra_env or {})
        self.grace_period = grace_period
        self.timeout = timeout
        self.stdout = stdout
        self.stderr = stderr
        self.lock = threading.Lock()
        self.workers: list[_Worker] = []
        self.received: list[int] = []  # signals received by the launcher, in order
        self.deadline = None if timeout is None else time.monotonic() + timeout

    # -- environment and start ------------------------------------------------------

    def _base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.env_mode == "torchrun":
            env.pop("TF_CONFIG", None)
        else:
            for name in TORCHRUN_VARS:
                env.pop(name, None)
        if self.nproc > 1 and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = "1"  # as torchrun does: no oversubscription
        return env

    def _start(self, attempt: int) -> None:
        base = self._base_env()
        per_worker = worker_environments(
            self.nproc,
            nnodes=self.nnodes,
            node_rank=self.node_rank,
            master=self.master,
            env_mode=self.env_mode,
            restart_count=attempt,
            max_restarts=self.max_restarts,
        )
        self.workers = []
        for local_rank, variables in enumerate(per_worker):
            rank = self.node_rank * self.nproc + local_rank
            env = {**base, **variables, **{k: str(v) for k, v in self.extra_env.items()}}
            proc = subprocess.Popen(
                self.command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            worker = _Worker(rank=rank, local_rank=local_rank, proc=proc)
            self.workers.append(worker)
            prefix = f"[rank {rank}] "
            for pipe, stream in ((proc.stdout, self.stdout), (proc.stderr, self.stderr)):
                thread = threading.Thread(
                    target=_forward,
                    args=(pipe, prefix, stream, self.lock),
                    name=f"td-launch-rank{rank}-{'out' if stream is self.stdout else 'err'}",
                    daemon=True,
                )
                thread.start()
                worker.readers.append(thread)

    # -- stop -----------------------------------------------------------------------

    def _stop_all(self) -> None:
        """SIGTERM every worker group, wait up to the grace period, SIGKILL what is left."""
        if not self.workers:
            return
        signals_seen = len(self.received)
        for worker in self.workers:
            _signal_group(worker, signal.SIGTERM)
        end = time.monotonic() + self.grace_period
        while any(_group_alive(w) for w in self.workers):
            if time.monotonic() >= end or len(self.received) > signals_seen:
                break  # grace over, or interrupted again: kill now
            time.sleep(_POLL_S)
        kill = getattr(signal, "SIGKILL", signal.SIGTERM)
        end = time.monotonic() + _KILL_WAIT_S
        while True:
            alive = [w for w in self.workers if _group_alive(w)]
            if not alive or time.monotonic() >= end:
                break
            for worker in alive:
                _signal_group(worker, kill)
            time.sleep(_POLL_S)
        for worker in self.workers:
            try:
                worker.proc.wait(timeout=_KILL_WAIT_S)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
                _log(self.stderr, f"worker rank {worker.rank} (pid {worker.pid}) did not exit")
        self._join_readers()

    def _join_readers(self) -> None:
        end = time.monotonic() + _READER_JOIN_S
        for worker in self.workers:
            for thread in worker.readers:
                # A pipe stays open only if a grandchild escaped its process group; the
                # reader threads are daemons, so do not wait for it forever.
                thread.join(timeout=max(0.0, end - time.monotonic()))

    # -- supervision ----------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.received.append(signum)

    def _watch(self) -> tuple[str, _Worker | None, int]:
        """Wait until all workers succeed, one fails, a signal arrives or time runs out."""
        while True:
            if self.received:
                return "signal", None, 0
            if self.deadline is not None and time.monotonic() >= self.deadline:
                return "timeout", None, 0
            codes = [w.proc.poll() for w in self.workers]
            failed = [(w, c) for w, c in zip(self.workers, codes, strict=True) if c is not None and c != 0]
            if failed:
                worker, code = failed[0]  # lowest rank among those that failed this poll
                return "failed", worker, code
            if all(c == 0 for c in codes):
                return "ok", None, 0
            time.sleep(_POLL_S)

    def run(self) -> int:
        attempt = 0
        while True:
            if self.received:
                return self._interrupted()
            self._start(attempt)
            outcome, worker, code = self._watch()
            if outcome == "ok":
                self._stop_all()  # reap stray grandchildren, join readers
                return 0
            if outcome == "signal":
                return self._interrupted()
            if outcome == "timeout":
                _log(self.stderr, f"timed out after {self.timeout:g} s; stopping all workers")
                self._stop_all()
                return EXIT_TIMEOUT
            assert worker is not None
            what = f"worker rank {worker.rank} (pid {worker.pid}) {_describe_status(code)}"
            self._stop_all()
            if self.received:
                return self._interrupted()
            if attempt < self.max_restarts:
                attempt += 1
                _log(
                    self.stderr,
                    f"restarting all workers (attempt {attempt}/{self.max_restarts}) after {what}",
                )
                continue
            if self.max_restarts:
                _log(self.stderr, f"no restarts left ({self.max_restarts} used)")
            _log(self.stderr, what)
            return _exit_code_for(code)

    def _interrupted(self) -> int:
        signum = self.received[0]
        name = signal.Signals(signum).name
        _log(self.stderr, f"received {name}; stopping all workers")
        self._stop_all()
        return 128 + signum

    def cleanup(self) -> None:
        """Last resort (an exception in the launcher): kill every worker group."""
        for worker in self.workers:
            if _group_alive(worker):
                _signal_group(worker, getattr(signal, "SIGKILL", signal.SIGTERM))
        for worker in self.workers:
            try:
                worker.proc.wait(timeout=_KILL_WAIT_S)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass


# ----------------------------------------------------------------------------- API


def launch(
    script_or_module_argv: Sequence[str],
    nproc: int,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    master: str | None = None,
    max_restarts: int = 0,
    env_mode: str = "torchrun",
    extra_env: Mapping[str, str] | None = None,
    grace_period: float = 10.0,
    timeout: float | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """Run ``nproc`` local workers of a Python script and return the launcher's exit code.

    ``script_or_module_argv`` is ``["train.py", *args]`` or ``["-m", "pkg.train", *args]``;
    each worker runs ``sys.executable -u`` with it. ``stdout``/``stderr`` (default: the
    current ``sys.stdout``/``sys.stderr``) receive the workers' lines prefixed with
    ``[rank R] ``; the launcher's own messages go to ``stderr``. ``extra_env`` is added to
    every worker's environment last. ``timeout`` (seconds, for tests) stops everything and
    returns 124 when it passes.

    Raises ``InvalidArgumentError`` for bad arguments, before any process starts.
    """
    argv = script_or_module_argv
    if not isinstance(argv, str):
        argv = list(argv)
    _validate(argv, nproc, nnodes, node_rank, master, max_restarts, env_mode, grace_period, timeout)
    supervisor = _Supervisor(
        [sys.executable, "-u", *argv],
        nproc=nproc,
        nnodes=nnodes,
        node_rank=node_rank,
        master=master,
        max_restarts=max_restarts,
        env_mode=env_mode,
        extra_env=extra_env,
        grace_period=float(grace_period),
        timeout=timeout,
        stdout=sys.stdout if stdout is None else stdout,
        stderr=sys.stderr if stderr is None else stderr,
    )
    handled = [signal.SIGINT, signal.SIGTERM]
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        handled.append(signal.SIGHUP)
    previous: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in handled:
            previous[sig] = signal.signal(sig, supervisor._on_signal)
    try:
        return supervisor.run()
    finally:
        try:
            supervisor.cleanup()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Start local worker processes of a training script with the environment "
        "torch-distribute strategies read, prefix their output with their rank, and stop "
        "them all when one fails.",
        epilog="Everything after the script (or -m module) is passed to the script.",
    )
    parser.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", type=int, default=1,
                        metavar="N", help="worker processes on this node (default 1)")
    parser.add_argument("--nnodes", type=int, default=1, metavar="M",
                        help="number of nodes (default 1)")
    parser.add_argument("--node-rank", "--node_rank", type=int, default=0, metavar="R",
                        help="rank of this node, 0..M-1 (default 0)")
    parser.add_argument("--master", default=None, metavar="HOST:PORT",
                        help="rendezvous address (node 0); required when --nnodes > 1; "
                        "default on one node: 127.0.0.1 and a free port per attempt")
    parser.add_argument("--max-restarts", "--max_restarts", type=int, default=0, metavar="K",
                        help="restart all local workers up to K times after a failure (default 0)")
    parser.add_argument("--env", choices=ENV_MODES, default="torchrun", dest="env_mode",
                        help="how workers learn the cluster: torchrun variables (default) or "
                        "a TF_CONFIG per worker (one node only)")
    parser.add_argument("--grace-period", "--grace_period", type=float, default=10.0,
                        metavar="S", help="seconds between SIGTERM and SIGKILL (default 10)")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="stop everything and exit 124 after S seconds (default: none)")
    parser.add_argument("-m", "--module", action="store_true",
                        help="run the target as a module, like python -m")
    parser.add_argument("script", metavar="script.py | module",
                        help="the training script (or module name with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="args",
                        help="arguments for the script")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: parse ``argv`` (default ``sys.argv[1:]``), launch, return the code."""
    parser = _parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        target = ["-m", args.script] if args.module else [args.script]
        command = [*target, *args.script_args]
        try:
            _validate(command, args.nproc, args.nnodes, args.node_rank, args.master,
                      args.max_restarts, args.env_mode, args.grace_period, args.timeout)
        except InvalidArgumentError as exc:
            parser.error(str(exc))
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return launch(
        command,
        args.nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master=args.master,
        max_restarts=args.max_restarts,
        env_mode=args.env_mode,
        grace_period=args.grace_period,
        timeout=args.timeout,
    )


if __name__ == "__main__":
    sys.exit(main())
