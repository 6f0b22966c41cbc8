"""Tasks forked by the standard library's forkserver, which imported torch once.

A fresh interpreter spends about 4 s of CPU importing ``torch`` and ``torch._dynamo`` before
a worker script does anything; a launcher that starts and restarts workers pays it for each.
``ForkserverTasks`` starts them instead as ``multiprocessing`` processes of the
``"forkserver"`` context, whose server imports those modules (and this package) once
(``multiprocessing.set_forkserver_preload``). The forked task then becomes the worker as
``python -u SCRIPT ARGS`` (or ``-m MODULE``, ``-c CODE``) would be: a session of its own, the
stdout and stderr it was handed (unbuffered), stdin from /dev/null, its working directory,
environment, ``sys.argv`` and a fresh interpreter's ``sys.path``, the script run in a new
``__main__``; an uncaught exception prints its traceback (``sys.excepthook``) and exits 1;
at the end non-daemon threads are joined and ``atexit`` runs, as at an interpreter's exit.

What multiprocessing does and a fresh interpreter would not: the task first imports the
starting process's main module as ``__mp_main__`` (the launcher's: ``torch_distribute.launch``),
with the start-up environment; and a task whose parent (the server) ends is killed
(``PR_SET_PDEATHSIG``): the server ends with the process that started it, so a launcher
killed outright takes its workers along.

Only Linux, only the interpreter this process runs, only ``-u`` and no other interpreter
option, and only tasks whose environment agrees with the server's in what Python and torch
read while they start (``PYTHON*``, ``OMP_*``, ``MKL_*``, ``TORCH*`` but ``TORCHELASTIC_*`` and
``TORCHINDUCTOR_CACHE_DIR``, ``CUDA*``, ``TD_LOG_LEVEL``, ...): ``why_not`` says why another
is not forked (the caller starts a fresh interpreter). The server is the process's one
forkserver, started by the first task with that task's start-up variables (this process's
``os.environ`` holds them for that moment: multiprocessing starts the server with it); it
imports nothing that initializes CUDA, so a worker may still pick its GPU.

>>> import os, sys
>>> tasks = ForkserverTasks()
>>> read, write = os.pipe()
>>> command = [sys.executable, "-u", "-c", "print('hello from', __name__)"]
>>> env = {**os.environ, "OMP_NUM_THREADS": "1"}
>>> tasks.why_not(command, env) is None
True
>>> task = tasks.start(command, env, stdout=write, stderr=write)
>>> os.close(write)
>>> task.wait(timeout=120), os.read(read, 100)
(0, b'hello from __main__\\n')
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.reduction
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["DEFAULT_PRELOAD", "ForkedTask", "ForkserverTasks"]

#: What the server imports before it forks: what every worker would import first (importing
#: this package changes nothing in torch or the process; what it reads at import,
#: ``TD_LOG_LEVEL``, is a start-up variable below).
DEFAULT_PRELOAD = ("torch", "torch._dynamo", "torch_distribute")
#: Environment variables read while Python, torch and this package start (prefixes): a
#: task whose environment differs from the server's in one of them is not forked.
_READ_AT_START = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "PYTORCH", "CUDA", "LD_",
                  "NVIDIA_", "HIP_", "ROCM_", "XLA_", "TD_LOG_LEVEL")
#: Read by a worker as it runs, never at start-up: the launcher's per attempt, and inductor's
#: cache directory (read when it compiles; torch sets it in its own process when unset).
_READ_LATER = ("TORCHELASTIC_", "TORCHINDUCTOR_CACHE_DIR")
_PR_SET_PDEATHSIG = 1
# The process has one forkserver: what it was started with, for every ForkserverTasks.
_server_lock = threading.Lock()
_server_env: dict[str, str] | None = None  # its start-up variables, once started
_fresh_path_found: list[str] | None = None  # sys.path[1:] of a fresh interpreter, asked once


def _start_time_variables(env: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items()
            if name.startswith(_READ_AT_START) and not name.startswith(_READ_LATER)}


class _PassedFd:
    """A file descriptor handed to the forked task: multiprocessing sends it along with the
    task (``reduction.DupFd``), and the task receives its own descriptor, an ``int``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return _received_fd, (multiprocessing.reduction.DupFd(self.fd),)


def _received_fd(duplicate: Any) -> int:
    return int(duplicate.detach())


class ForkedTask:
    """A task the forkserver forked, with the part of ``subprocess.Popen`` a supervisor uses:
    ``args``, ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``,
    ``kill`` (a status is negative for a signal, as ``Popen``'s)."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: Sequence[str]) -> None:
        self.args = list(args)
        self._process = process
        self.pid: int = process.pid  # type: ignore[assignment]  # started
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkserverTasks:
    """Starts tasks from this process's forkserver; see the module docstring. Thread-safe."""

    def __init__(self, preload: Sequence[str] = DEFAULT_PRELOAD) -> None:
        self.preload = list(preload)
        self._context = multiprocessing.get_context("forkserver")

    def start_server(self, env: Mapping[str, str]) -> dict[str, str]:
        """Start the process's forkserver now with ``env``'s start-up variables, unless it
        runs; return the start-up variables it runs with."""
        global _server_env
        with _server_lock:
            if _server_env is None:
                wanted = _start_time_variables(env)
                self._context.set_forkserver_preload(self.preload)
                with _start_time_environment(wanted):
                    multiprocessing.forkserver.ensure_running()
                _server_env = wanted
            return dict(_server_env)

    def why_not(self, command: Sequence[str], env: Mapping[str, str]) -> str | None:
        """Why ``command`` with ``env`` cannot be forked (None: it can)."""
        if not sys.platform.startswith("linux"):
            return "forking needs Linux"
        target = command[2] if len(command) > 2 else "-"
        if (list(command[:2]) != [sys.executable, "-u"]
                or (len(command) < 4 if target in ("-c", "-m") else target.startswith("-"))):
            return f"only `{sys.executable} -u script|-m module|-c code` is forked"
        with _server_lock:
            if _server_env is None:
                return None
            server = _server_env
        ours = _start_time_variables(env)
        differing = sorted(name for name in server.keys() | ours.keys() if server.get(name) != ours.get(name))
        if differing:
            return f"its {', '.join(differing)} {'differs' if len(differing) == 1 else 'differ'} from the forkserver's"
        return None

    def start(self, command: Sequence[str], env: Mapping[str, str], *, stdout: int, stderr: int,
              cwd: str | None = None) -> ForkedTask:
        """Fork ``command`` (``[python, "-u", script|-c CODE|-m MODULE, *args]``, checked
        with ``why_not``) with ``env``, its output to the file descriptors ``stdout`` and
        ``stderr`` (the caller keeps and closes its own); the first starts the server with
        ``env``'s start-up variables. Raises ``OSError`` when the server cannot start or fork."""
        self.start_server(env)
        task_args = (list(command[2:]), dict(env), cwd if cwd is not None else os.getcwd(),
                     _fresh_path(), _PassedFd(stdout), _PassedFd(stderr))
        process = self._context.Process(target=_run_task, args=task_args, name=f"td-task-{command[2]}")
        process.start()
        return ForkedTask(process, command)


def _fresh_path() -> list[str]:
    """``sys.path`` after its first entry in a fresh interpreter without ``PYTHONPATH``
    (site-packages and what ``.pth`` files add), asked of one once per process."""
    global _fresh_path_found
    if _fresh_path_found is None:
        clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        output = subprocess.run([sys.executable, "-c", "import sys, json; print(json.dumps(sys.path[1:]))"],
                                env=clean, capture_output=True, check=True, text=True, timeout=60).stdout
        _fresh_path_found = list(json.loads(output))
    return _fresh_path_found


@contextlib.contextmanager
def _start_time_environment(wanted: dict[str, str]) -> Any:
    """``os.environ`` holding exactly ``wanted`` of the start-up variables meanwhile."""
    saved = {name: os.environ.get(name) for name in _start_time_variables(os.environ).keys() | wanted.keys()}
    for name in saved:
        if name in wanted:
            os.environ[name] = wanted[name]
        else:
            del os.environ[name]
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# -- in the forked task ------------------------------------------------------------------


def _run_task(argv: list[str], env: dict[str, str], cwd: str, default_path: list[str],
              stdout: int, stderr: int) -> None:
    """Become the worker (see the module docstring) and exit as its interpreter would."""
    server = os.getppid()
    os.setsid()
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != server:  # the server ended before prctl: nothing would stop us
        os._exit(1)
    _forget_the_forkserver()
    for target, fd in ((1, stdout), (2, stderr)):
        os.dup2(fd, target)
    for fd in {stdout, stderr}:
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    _unbuffered_streams()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    python_path = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = list(dict.fromkeys(python_path)) + default_path
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # seeded once in the server: a fresh interpreter seeds its own
        numpy.random.seed()
    code = _run_as_main(argv, cwd)
    _exit(code)


def _forget_the_forkserver() -> None:
    """Close this task's copy of the server's "alive" pipe, which multiprocessing hands every
    forked process: the server then ends as soon as the process that started it does (and
    this task with it, ``PR_SET_PDEATHSIG``), however its tasks are doing; and the task, as a
    fresh interpreter, has no forkserver of its own until it starts one."""
    server = multiprocessing.forkserver._forkserver
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        with contextlib.suppress(OSError):
            os.close(alive)
        server._forkserver_alive_fd = None  # type: ignore[attr-defined]
    server._inherited_fds = None  # type: ignore[attr-defined]


def _unbuffered_streams() -> None:
    """``sys.stdout``/``sys.stderr`` as ``python -u`` has them, on descriptors 1 and 2."""
    import io

    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding,
                                  errors=old.errors, write_through=True, line_buffering=False)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _run_as_main(argv: list[str], cwd: str) -> int:
    """Run ``argv`` (script, ``-c CODE`` or ``-m MODULE``, then its arguments) in a new
    ``__main__`` as ``python`` would; the exit status it asked for."""
    import builtins
    import importlib.machinery
    import types

    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __annotations__={},
                         __loader__=importlib.machinery.BuiltinImporter)
    sys.modules["__main__"] = main
    try:
        if argv[0] == "-m":
            import runpy

            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, cwd)
            runpy._run_module_as_main(argv[1], alter_argv=True)  # type: ignore[attr-defined]  # what ``python -m`` calls
            return 0
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            code = compile(argv[1], "<string>", "exec")
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            main.__dict__.update(__loader__=importlib.machinery.SourceFileLoader("__main__", argv[0]),
                                 __file__=argv[0], __cached__=None)
            with open(argv[0], "rb") as source:
                code = compile(source.read(), argv[0], "exec")
        exec(code, main.__dict__)
        return 0
    except SystemExit as exit_:
        return _exit_status(exit_.code)
    except BaseException as error:  # noqa: BLE001 - printed as the interpreter would
        # The traceback from the script's own frames on, without this module's.
        traceback = error.__traceback__
        while traceback is not None and traceback.tb_frame.f_code.co_filename == __file__:
            traceback = traceback.tb_next
        error = error.with_traceback(traceback)
        # As the interpreter's own printing does: atexit handlers read these to tell a
        # program that died of an exception from one that finished.
        sys.last_type, sys.last_value, sys.last_traceback = type(error), error, traceback
        if sys.version_info >= (3, 12):
            sys.last_exc = error
        sys.excepthook(type(error), error, traceback)
        return -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _exit(code: int) -> None:
    """End as the interpreter ends: join non-daemon threads, run ``atexit``, flush, exit."""
    import atexit

    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter calls at exit
    except BaseException:  # noqa: BLE001 - a KeyboardInterrupt while joining: go on ending
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code == -signal.SIGINT:  # as the interpreter does after an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)
