"""Worker processes forked from an interpreter that has imported torch once.

A fresh interpreter spends about 4 s of CPU importing ``torch`` and ``torch._dynamo`` (which
torch loads when the first optimizer is made) before a worker script does anything; a
launcher that starts and restarts workers pays it for each of them. A
``PreloadedInterpreter`` starts one server process the first time it is asked for a
worker: the server imports those modules once, then forks a child for each request. The
child becomes the worker as ``python -u SCRIPT ARGS`` (or ``-m MODULE``, ``-c CODE``) would:
a session of its own, the stdout and stderr it was handed, stdin from /dev/null, the
request's working directory, environment and ``sys.argv``, and the script run in
``__main__``, so that its objects live until the interpreter tears down and ``atexit`` runs
as usual. An uncaught exception prints its traceback (through ``sys.excepthook``), is left in
``sys.last_value`` and exits 1; ``sys.exit`` and signals end it as they would a fresh interpreter.

Only Linux (a worker dies with its server: ``PR_SET_PDEATHSIG``), only the interpreter this
process runs, only ``-u`` and no other interpreter option, and only an environment that
agrees with the server's in what Python and torch read while they start (``PYTHON*``,
``OMP_*``, ``MKL_*``, ``TORCH*`` but ``TORCHELASTIC_*`` and ``TORCHINDUCTOR_CACHE_DIR``,
``CUDA*``, ...; a ``PYTHONPATH`` of the worker's own, where the server has none, goes onto
its ``sys.path`` unless it holds a module the server has imported): ``can_start`` says no to
anything else, and the caller starts a fresh interpreter. The server imports nothing
that initializes CUDA, so a worker may still pick its GPU.

The server ends, killing the workers it forked, when its client closes it or when the
process that started it is gone. Other processes may use it too (``shared=``, which launchers
read from ``TD_PRELOADED_SERVER``: one import of torch for many launches, as a test suite or
an edit-and-relaunch loop makes): a worker is then killed, with its process group, as soon as
the connection that asked for it closes, so a launcher that dies takes its workers along
whoever started the server. A worker inherits its server's namespaces, cgroup, user, limits
and CPU set: a process whose own differ from the shared server's is not served by it.

>>> import os, sys
>>> interpreter = PreloadedInterpreter(preload=())
>>> read, write = os.pipe()
>>> command = [sys.executable, "-u", "-c", "print('hello from', __name__)"]
>>> interpreter.can_start(command, dict(os.environ))
True
>>> worker = interpreter.start(command, dict(os.environ), stdout=write, stderr=write)
>>> os.close(write)
>>> worker.wait(timeout=60), os.read(read, 100)
(0, b'hello from __main__\\n')
>>> interpreter.close()

The protocol, one UNIX-socket connection per worker: the client sends a header line with
the request's length and, with it, the two file descriptors (``SCM_RIGHTS``), then the
request as JSON (``argv``, ``env``, ``cwd``); the server answers ``pid N`` once forked and
``exit CODE`` when it has reaped the child (CODE as ``subprocess.Popen.returncode``:
negative for a signal). Beside the socket, ``socket.json`` tells the processes that share
the server its interpreter, process context, start-up environment and imported modules.
This file imports only the standard library: the server loads it by its path, so that its
workers' ``sys.path`` is a fresh interpreter's.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import importlib
import importlib.machinery
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["DEFAULT_PRELOAD", "SHARED_SERVER_ENV", "ForkedProcess", "PreloadedInterpreter"]

#: The variable that names a server for several launchers to share (its ``address``).
SHARED_SERVER_ENV = "TD_PRELOADED_SERVER"
#: What the server imports before it forks: what every worker would import first.
DEFAULT_PRELOAD = ("torch", "torch._dynamo")
#: Environment variables read while Python and torch start (prefixes): a worker whose
#: environment differs from the server's in one of them is not forked.
_READ_AT_START = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "PYTORCH", "CUDA", "LD_",
                  "NVIDIA_", "HIP_", "ROCM_", "XLA_")
#: Read by a worker as it runs, never at start-up: the launcher's per attempt, and inductor's
#: cache directory (read when it compiles; torch sets it in its own process when unset).
_READ_LATER = ("TORCHELASTIC_", "TORCHINDUCTOR_CACHE_DIR")
_SERVER_START_S = 120.0
#: A UNIX socket's path has at most 107 bytes on Linux: its directory must leave room for "/socket".
_SOCKET_DIRECTORY_MAX = 90
_PR_SET_PDEATHSIG = 1


def _start_time_variables(env: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items()
            if name.startswith(_READ_AT_START) and not name.startswith(_READ_LATER)}


#: What a process inherits from the one that starts it, besides its environment, as
#: /proc/self/status shows it.
_INHERITED_STATUS = ("Uid", "Gid", "Groups", "Umask", "Cpus_allowed_list", "Mems_allowed_list",
                     "NoNewPrivs", "Seccomp", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")


def _process_context() -> dict[str, str]:
    """What a worker inherits from the process that starts it besides its environment: its
    namespaces (network, mount, ...), cgroup, user and groups, umask, CPUs, capabilities,
    resource limits and niceness. A worker forked by a shared server gets the server's."""
    import resource

    context = {}
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir("/proc/self/ns")):
            context[f"{name} namespace"] = os.readlink(f"/proc/self/ns/{name}")
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as cgroup:
        context["cgroup"] = cgroup.read()
    with contextlib.suppress(OSError), open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in _INHERITED_STATUS:
                context[key] = value.strip()
    for name in sorted(vars(resource)):
        if name.startswith("RLIMIT_"):
            context[name] = repr(resource.getrlimit(getattr(resource, name)))
    context["niceness"] = str(os.getpriority(os.PRIO_PROCESS, 0))
    return context


def _differ(names: Sequence[str]) -> str:
    return f"{names[0]} differs" if len(names) == 1 else f"{', '.join(names)} differ"


def _python_path(env: Mapping[str, str]) -> list[str]:
    """``PYTHONPATH``'s entries as a fresh interpreter puts them on ``sys.path`` (absolute)."""
    value = env.get("PYTHONPATH", "")
    return list(dict.fromkeys(os.path.abspath(entry) for entry in value.split(os.pathsep))) if value else []


def _shadowed(entries: Sequence[str], modules: Sequence[str]) -> list[str]:
    """Which of the server's imported ``modules`` a worker would import from ``entries``
    (a directory without ``__init__.py``, a namespace portion, yields to any module)."""
    found = ((name, entry, importlib.machinery.PathFinder.find_spec(name, [entry]))
             for entry in entries for name in modules)
    return [f"{name} ({entry})" for name, entry, spec in found if spec is not None and spec.loader is not None]


class ForkedProcess:
    """A worker forked by the server, with the part of ``subprocess.Popen`` a supervisor
    uses: ``args``, ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``,
    ``terminate``, ``kill``. The server is its parent and tells its exit status."""

    def __init__(self, connection: socket.socket, args: Sequence[str]) -> None:
        self.args = list(args)
        self.returncode: int | None = None
        self._connection = connection
        self._received = b""
        self._lock = threading.Lock()
        reply = self._line(_SERVER_START_S)
        if not reply or not reply.startswith("pid "):
            connection.close()
            raise OSError(f"the preloaded interpreter did not start {self.args}: {reply!r}")
        self.pid = int(reply.split()[1])

    def poll(self) -> int | None:
        return self._exit_status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:  # in short slices, so that another thread may poll meanwhile
            left = 0.1 if deadline is None else min(0.1, max(0.0, deadline - time.monotonic()))
            code = self._exit_status(left)
            if code is not None:
                return code
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _exit_status(self, timeout: float | None) -> int | None:
        with self._lock:
            if self.returncode is None:
                line = self._line(timeout)
                if line is not None:
                    # An end without a status: the server is gone, and its workers with it.
                    self.returncode = int(line.split()[1]) if line.startswith("exit ") else -signal.SIGKILL
                    self._connection.close()
            return self.returncode

    def _line(self, timeout: float | None) -> str | None:
        """The server's next line ("" at the end of the connection), None after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._received:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._connection], [], [], left)[0]:
                return None
            try:
                chunk = self._connection.recv(4096)
            except OSError:
                chunk = b""
            if not chunk:
                return ""
            self._received += chunk
        line, self._received = self._received.split(b"\n", 1)
        return line.decode()


class PreloadedInterpreter:
    """Forks workers from one interpreter that imported ``preload`` once; see the module
    docstring. Thread-safe; ``close`` ends the server and the workers it still has."""

    def __init__(self, preload: Sequence[str] = DEFAULT_PRELOAD, python: str = sys.executable,
                 *, shared: str | None = None) -> None:
        self.preload = tuple(preload)
        self.python = python
        #: Another process's server (its address), used instead of starting one of our own
        #: for every worker whose start-up environment agrees with that server's.
        self.shared = shared or None
        self._shared_description: dict[str, Any] | None = None
        self._context: dict[str, str] | None = None  # this process's, compared with the shared server's
        self._shadowed_by_path: dict[str, list[str]] = {}  # by PYTHONPATH: asked for each worker, thrice
        self._server: subprocess.Popen[bytes] | None = None
        self._directory = ""
        self._env: dict[str, str] | None = None
        self._lock = threading.Lock()

    def start_server(self, env: Mapping[str, str]) -> str:
        """Start this object's own server now, with ``env`` (the start-up environment its
        workers must share), unless it runs; return its address (its socket's path), which
        other processes may pass as ``shared`` (launchers read ``TD_PRELOADED_SERVER``)."""
        with self._lock:
            if self._server is None or self._server.poll() is not None:
                if self._directory:  # a server that died: its socket's directory too
                    shutil.rmtree(self._directory, ignore_errors=True)
                self._start_server(dict(env))
            return os.path.join(self._directory, "socket")

    def shared_mismatch(self, env: Mapping[str, str]) -> str | None:
        """Why the ``shared`` server cannot fork a worker with ``env`` (None: it can, or
        there is none). Such a worker is forked by a server of this object's own."""
        if self.shared is None:
            return None
        description = self._shared_description
        if description is None:
            try:
                with open(self.shared + ".json") as written:
                    description = self._shared_description = json.load(written)
            except (OSError, ValueError) as error:
                return f"no preloaded interpreter answers at {self.shared} ({error})"
        if description["python"] != self.python:
            return f"it runs {description['python']}, the workers {self.python}"
        if self._context is None:
            self._context = _process_context()
        theirs_context = description["context"]
        different = sorted(key for key in theirs_context.keys() | self._context.keys()
                           if theirs_context.get(key) != self._context.get(key))
        if different:  # another network namespace, cgroup (a SLURM step), user, limits, ...
            return f"its {_differ(different)} from this process's"
        theirs, ours = description["start_env"], _start_time_variables(env)
        differing = sorted(name for name in theirs.keys() | ours.keys()
                           if theirs.get(name) != ours.get(name) and name != "PYTHONPATH")
        if differing:
            return f"the workers' {_differ(differing)} from its own"
        # A PYTHONPATH of the workers' own (the server has none) goes onto their sys.path as
        # a fresh interpreter's would, unless it holds a module the server imported elsewhere.
        if theirs.get("PYTHONPATH", "") not in ("", ours.get("PYTHONPATH", "")):
            return "its PYTHONPATH differs from the workers'"
        python_path = ours.get("PYTHONPATH", "")
        if python_path != theirs.get("PYTHONPATH", ""):
            if python_path not in self._shadowed_by_path:  # a lookup per imported module and entry
                self._shadowed_by_path[python_path] = _shadowed(_python_path(ours), description["modules"])
            shadowed = self._shadowed_by_path[python_path]
            if shadowed:
                return (f"the workers' PYTHONPATH holds {', '.join(shadowed)}, which it imported "
                        "from elsewhere")
        return None

    def can_start(self, command: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether ``command`` with ``env`` can be forked (else start a fresh interpreter)."""
        if not sys.platform.startswith("linux") or len(command) < 3:
            return False
        if command[0] != self.python or command[1] != "-u":
            return False
        script = command[2]
        if script in ("-c", "-m"):
            if len(command) < 4:
                return False
        elif script.startswith("-"):
            return False
        if self.shared is not None and self.shared_mismatch(env) is None:
            return True
        with self._lock:
            return self._env is None or _start_time_variables(env) == _start_time_variables(self._env)

    def start(self, command: Sequence[str], env: Mapping[str, str], *, stdout: int, stderr: int,
              cwd: str | None = None) -> ForkedProcess:
        """Fork ``command`` (``[python, "-u", script|-c CODE|-m MODULE, *args]``, checked
        with ``can_start``) with ``env``, its output to the file descriptors ``stdout`` and
        ``stderr`` (the caller keeps and closes its own). Raises ``OSError`` when the server
        cannot start or is gone. A ``shared`` server that is gone is not asked again."""
        request = json.dumps({"argv": list(command[2:]), "env": dict(env),
                              "cwd": cwd if cwd is not None else os.getcwd()}).encode()
        if self.shared is not None and self.shared_mismatch(env) is None:
            try:
                return ForkedProcess(_send_request(self.shared, request, stdout, stderr), command)
            except OSError:
                self.shared = None  # gone: this object's own server from now on
        return ForkedProcess(_send_request(self.start_server(env), request, stdout, stderr), command)

    def close(self) -> None:
        """End this object's own server; the workers it forked that still run are killed with
        it. (A ``shared`` server kills a worker when the connection that asked for it closes.)"""
        with self._lock:
            server, self._server = self._server, None
            if server is not None and server.poll() is None:
                server.kill()
                server.wait()
            if self._directory:
                shutil.rmtree(self._directory, ignore_errors=True)
                self._directory = ""
            self._env = None

    def _start_server(self, env: dict[str, str]) -> None:
        self._directory = tempfile.mkdtemp(prefix="td-preloaded-")
        if len(self._directory) > _SOCKET_DIRECTORY_MAX:  # a long TMPDIR: a UNIX socket's path is short
            os.rmdir(self._directory)
            self._directory = tempfile.mkdtemp(prefix="td-preloaded-", dir="/tmp")
        address = os.path.join(self._directory, "socket")
        # Without "-c"'s "" (the working directory) on sys.path: what the server imports comes
        # from where a worker's own interpreter would import it.
        load = ("import sys; del sys.path[0]; import importlib.util as u; "
                f"s = u.spec_from_file_location('td_preloaded_interpreter', {__file__!r}); "
                f"m = u.module_from_spec(s); s.loader.exec_module(m); "
                f"m.serve({address!r}, {list(self.preload)!r})")
        log = os.path.join(self._directory, "server.log")
        with open(log, "wb") as out:
            # A session of its own: the terminal's Ctrl-C is the supervisor's to handle.
            self._server = subprocess.Popen([self.python, "-u", "-c", load], env=env,
                                            stdin=subprocess.DEVNULL, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        self._env = env
        deadline = time.monotonic() + _SERVER_START_S
        while not os.path.exists(address + ".ready"):
            if self._server.poll() is not None or time.monotonic() > deadline:
                with open(log, "rb") as written:
                    text = written.read()[-2000:].decode(errors="replace")
                self._server.kill()
                self._server.wait()
                raise OSError(f"the preloaded interpreter did not start: {text}")
            time.sleep(0.02)


def _send_request(address: str, request: bytes, stdout: int, stderr: int) -> socket.socket:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(address)
        socket.send_fds(connection, [f"{len(request)}\n".encode()], [stdout, stderr])
        connection.sendall(request)
    except OSError:
        connection.close()
        raise
    return connection


# -- the server (runs in its own interpreter) --------------------------------------------


def serve(address: str, preload: Sequence[str]) -> None:
    """Import ``preload``, then fork a worker per request until the parent is gone."""
    # Workers get no blocked signal from whoever started the server (a launcher's are free).
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for name in preload:
        importlib.import_module(name)
    request, fds = _serve_until_forked(address)
    _become_worker(request, fds)  # only a forked child gets here


def _serve_until_forked(address: str) -> tuple[dict[str, Any], list[int]]:
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(128)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wake-up fd hears it
    children: dict[int, socket.socket] = {}
    abandoned: set[int] = set()  # workers whose client is gone, killed, not yet reaped
    with open(address + ".json", "w") as description:
        json.dump({"python": sys.executable, "context": _process_context(),
                   "start_env": _start_time_variables(os.environ),
                   "modules": sorted(name for name in sys.modules if "." not in name)}, description)
    with open(address + ".ready", "w"):
        pass
    while True:
        clients = {connection.fileno(): pid for pid, connection in children.items() if pid not in abandoned}
        readable, _, _ = select.select([listener.fileno(), wake_read, *clients], [], [], 1.0)
        if os.getppid() != parent:  # the process that started us is gone: so are the workers
            for pid in children:
                _kill_worker(pid)
            shutil.rmtree(os.path.dirname(address), ignore_errors=True)  # nobody else will
            os._exit(0)
        if wake_read in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_read, 4096)
        for fd in readable:
            if fd in clients:  # a client sends nothing after its request: it closed or died
                _kill_worker(clients[fd])
                abandoned.add(clients[fd])
        _reap(children)
        abandoned &= children.keys()
        if listener.fileno() not in readable:
            continue
        connection, _ = listener.accept()
        try:
            request, fds = _read_request(connection)
        except (OSError, ValueError):  # a client gone before asking: nothing to start
            connection.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for open_socket in (listener, connection, *children.values()):
                open_socket.close()
            os.close(wake_read)
            os.close(wake_write)
            return request, fds
        for fd in fds:
            os.close(fd)
        connection.sendall(f"pid {pid}\n".encode())
        children[pid] = connection


def _kill_worker(pid: int) -> None:
    """Kill a worker and what it started in its session (its process group)."""
    for kill in (os.killpg, os.kill):  # os.kill too: a worker just forked has no session yet
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


def _read_request(connection: socket.socket) -> tuple[dict[str, Any], list[int]]:
    header, fds, _, _ = socket.recv_fds(connection, 64, 2)
    if len(fds) != 2 or not header.endswith(b"\n"):
        for fd in fds:
            os.close(fd)
        raise ValueError("no request")
    size = int(header)
    body = b""
    while len(body) < size:
        chunk = connection.recv(size - len(body))
        if not chunk:
            for fd in fds:
                os.close(fd)
            raise ValueError("the request was cut short")
        body += chunk
    return json.loads(body), fds


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            with contextlib.suppress(OSError):
                connection.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            connection.close()


def _become_worker(request: dict[str, Any], fds: list[int]) -> None:
    server = os.getppid()
    os.setsid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != server:  # the server died before prctl: nothing would stop us
        os._exit(1)
    for target, fd in zip((1, 2), fds, strict=True):
        os.dup2(fd, target)
    for fd in set(fds):
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.chdir(request["cwd"])
    # The worker's PYTHONPATH, where the server has none (else they are the same: can_start).
    added = [] if _python_path(os.environ) else _python_path(request["env"])
    sys.path[:] = added + [entry for entry in sys.path if entry not in added]
    os.environ.clear()
    os.environ.update(request["env"])
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # seeded once in the server: a fresh interpreter seeds its own
        numpy.random.seed()
    _run_as_main(request["argv"], request["cwd"])


def _run_as_main(argv: list[str], cwd: str) -> None:
    """Run ``argv`` (script, ``-c CODE`` or ``-m MODULE``, then its arguments) in
    ``__main__`` as ``python`` would."""
    main = sys.modules["__main__"]
    main.__dict__.clear()
    # What a fresh interpreter's __main__ holds before the script runs.
    main.__dict__.update(__name__="__main__", __doc__=None, __package__=None,
                         __loader__=importlib.machinery.BuiltinImporter, __spec__=None,
                         __annotations__={}, __builtins__=builtins)
    try:
        if argv[0] == "-m":
            import runpy

            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, cwd)
            runpy._run_module_as_main(argv[1], alter_argv=True)  # type: ignore[attr-defined]  # what ``python -m`` calls
            return
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
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as error:  # noqa: BLE001 - printed as the interpreter would
        # The traceback from the script's own frames on, without the server's.
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
        sys.exit(1)
