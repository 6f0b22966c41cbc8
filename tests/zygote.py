"""An interpreter that has imported torch once and forks the tests' worker processes.

Started by ``proc_helpers`` (one per pytest process, on first use) as ``python -u -c``, loading
this file by its path (so that the workers' ``sys.path`` stays a fresh interpreter's) and
calling ``serve(ADDRESS)``, with the environment the tests give their workers. It imports what every worker imports
(``torch``, and ``torch._dynamo``, which torch loads when the first optimizer is made): about
5 s of CPU that each of the suite's hundreds of worker processes would otherwise spend on its
own, on a 2-core machine. Then, for each request on its UNIX socket, it forks a child that
becomes the worker: a session of its own, stdout and stderr to the worker's log, stdin from
/dev/null, the request's working directory, environment and ``sys.argv``, and the script (a
path, ``-c CODE`` or ``-m MODULE``) executed in ``__main__`` as ``python -u`` would, so that
its objects live until the interpreter tears down and ``atexit`` runs as usual. An uncaught
exception prints its traceback and exits 1; ``sys.exit`` and signals end it as they would.

The protocol, one connection per worker: the client sends one JSON line (``argv``, ``env``,
``cwd``, ``log``); the server answers ``pid N`` once forked and ``exit CODE`` when it has
reaped the child (CODE as ``subprocess.Popen.returncode``: negative for a signal). The server
ends when its parent (the pytest process) is gone, killing the workers it forked.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import json
import os
import select
import signal
import socket
import sys

PRELOAD = ("torch", "torch._dynamo")


def serve(address: str) -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    request = _serve_until_forked(address)
    _become_worker(request)  # only a forked child gets here


def _serve_until_forked(address: str) -> dict:
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
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([listener, wake_read], [], [], 1.0)
        if os.getppid() != parent:  # the tests are gone: so are their workers
            for pid in children:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            os._exit(0)
        if wake_read in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_read, 4096)
        _reap(children)
        if listener not in readable:
            continue
        connection, _ = listener.accept()
        try:
            request = json.loads(connection.makefile("r").readline())
        except ValueError:  # a client gone before asking: nothing to start
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
            return request
        connection.sendall(f"pid {pid}\n".encode())
        children[pid] = connection


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


def _become_worker(request: dict) -> None:
    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # seeded once in this server: a fresh interpreter seeds its own
        numpy.random.seed()
    argv = request["argv"]
    main = sys.modules["__main__"]
    main.__dict__.clear()
    main.__dict__.update(__name__="__main__", __builtins__=builtins, __doc__=None, __spec__=None,
                         __package__=None, __loader__=None)
    if argv[0] == "-m":
        import runpy

        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = request["cwd"]
        runpy._run_module_as_main(argv[1], alter_argv=True)  # what ``python -m`` calls
        return
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        code = compile(argv[1], "<string>", "exec")
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        main.__dict__["__file__"] = argv[0]
        with open(argv[0], "rb") as source:
            code = compile(source.read(), argv[0], "exec")
    exec(code, main.__dict__)
