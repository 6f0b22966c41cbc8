"""The RPC layer of parameter-server training: authenticated channels between the tasks.

Every task (chief, workers, parameter servers) serves a ``secure_channel.ChannelServer`` at
its own ``TF_CONFIG`` address and calls the others through ``ChannelClient`` connections,
one per peer, made on first use. Both ends of every connection prove the job secret
(``TD_JOB_SECRET``, see docs/security.md) before anything else, every message carries a MAC
checked before it is parsed, and only the library's entry points (registered with
``entry_points``) can be called: a request naming anything else is refused and logged.
``torch.distributed.rpc`` (TensorPipe), used before, let any process that reached the chief
join the group and run any function in every task.

Membership: a worker or ps task registers with the chief (``_register``); the chief numbers
its incarnations, so a restarted worker joins again as ``"worker:1:2"`` (its name changes,
its address does not) while the others keep running. ``Membership.current_name`` gives the
live incarnation of a task, as the chief knows it.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from torch_distribute.collectives import job_secret
from torch_distribute.collectives.failure_kind import FailureKind, failure_kind
from torch_distribute.errors import InvalidArgumentError
from torch_distribute.ps.secure_channel import ChannelClient, ChannelServer

__all__ = ["CHIEF", "Membership", "call_async", "call_sync", "entry_points", "join", "leave", "ping", "probe",
           "task_key", "wait_for"]

CHIEF = "chief:0"
_UNAUTHENTICATED_KEY = b"torch-distribute: a job without a secret"
_CONNECT_RETRY_S = 0.2

_lock = threading.Lock()
_entry_points: dict[str, Callable[..., Any]] = {}
_names: dict[Callable[..., Any], str] = {}


def task_key(task_type: str, index: int) -> str:
    return f"{task_type}:{index}"


def entry_points(*functions: Callable[..., Any]) -> None:
    """Allow ``functions`` (the library's own) to be called by the other tasks of the job."""
    for function in functions:
        name = f"{function.__module__}:{function.__qualname__}"
        _entry_points[name] = function
        _names[function] = name


def _bind_address(host: str, port: int) -> tuple[str, int]:
    """Where a task listens: its own address when it is a literal IP or localhost, else every
    interface (a host name may resolve to loopback here and to another address elsewhere)."""
    if job_secret.is_local_address(host):
        return ("::1" if ":" in host else "127.0.0.1"), port
    try:
        import ipaddress

        ipaddress.ip_address(host.strip("[]"))
        return host.strip("[]"), port
    except ValueError:
        return "0.0.0.0", port


class _Node:
    """This task: its server, its connections to the others, and (on the chief) the members."""

    def __init__(self, name: str, secret: bytes, addresses: Mapping[str, tuple[str, int]], num_threads: int):
        self.name = name
        self.secret = secret
        self.addresses = dict(addresses)
        self.server: ChannelServer | None = None
        self.num_threads = num_threads
        self.clients: dict[str, ChannelClient] = {}
        self.connecting: dict[str, threading.Lock] = {}
        self.members: dict[str, str] = {}
        self.incarnations: dict[str, int] = {}
        self.lock = threading.Lock()

    def serve(self, address: tuple[str, int]) -> None:
        self.server = ChannelServer(_bind_address(*address), self.secret, _entry_points, name=self.name,
                                    num_threads=self.num_threads)

    def client(self, name: str, timeout: float) -> ChannelClient:
        """The open connection to task ``name``, made (one at a time per peer) if needed."""
        with self.lock:
            existing = self.clients.get(name)
            connecting = self.connecting.setdefault(name, threading.Lock())
        if existing is not None and existing.alive:
            return existing
        with connecting:
            with self.lock:
                existing = self.clients.get(name)
            if existing is not None and existing.alive:
                return existing
            key = ":".join(name.split(":")[:2])
            address = self.addresses.get(key)
            if address is None:
                raise ConnectionError(f"unknown task {name!r} (not in the cluster)")
            made = ChannelClient(address, self.secret, name=self.name,
                                 connect_timeout=timeout if timeout > 0 else 30.0)
            with self.lock:
                self.clients[name] = made
            if existing is not None:
                existing.close()
            return made

    def close(self) -> None:
        with self.lock:
            clients, self.clients = list(self.clients.values()), {}
        for connection in clients:
            connection.close()
        if self.server is not None:
            self.server.close()


_node: _Node | None = None


def _register(key: str) -> str:
    """Entry point on the chief: task ``key`` (``"worker:1"``) joined; its name for this incarnation."""
    node = _node
    if node is None:
        raise RuntimeError("this task is not the chief of a parameter-server job")
    with node.lock:
        incarnation = node.incarnations.get(key, 0) + 1
        node.incarnations[key] = incarnation
        name = key if incarnation == 1 else f"{key}:{incarnation}"
        node.members[key] = name
    return name


def _pong() -> bool:
    return True


entry_points(_register, _pong)


class Membership:
    """This task's view of the group: its name and (on the chief) the current names of tasks."""

    def __init__(self, node: _Node):
        self._node = node
        self.name = node.name

    def current_name(self, key: str) -> str | None:
        """The name of the live incarnation of task ``key`` (``"worker:1"``), if it joined."""
        with self._node.lock:
            return self._node.members.get(key)


class Future:
    """The reply of a call: ``wait()`` returns it or raises the remote error."""

    def __init__(self, future: concurrent.futures.Future[Any], timeout: float, name: str):
        self._future = future
        self._timeout = timeout if timeout > 0 else None
        self._name = name

    def wait(self) -> Any:
        try:
            return self._future.result(self._timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"call to {self._name} timed out after {self._timeout:g} s") from None

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self._future.add_done_callback(lambda _f: callback(self))


def call_async(name: str, function: Callable[..., Any], args: tuple = (), timeout: float = 60.0) -> Future:
    """Call the entry point ``function`` on task ``name`` with ``args`` (sent by value).

    ``timeout`` (seconds; 0: none) bounds the wait for the reply. Raises ``OSError``/
    ``ConnectionError`` when the task cannot be reached.
    """
    node = _node
    if node is None:
        raise ConnectionError("this process has not joined a parameter-server job (or has left it)")
    entry = _names.get(function)
    if entry is None:
        raise InvalidArgumentError(f"{function!r} is not an entry point of the parameter-server transport.")
    for attempt in range(2):
        connection = node.client(name, timeout)
        try:
            return Future(connection.call_async(entry, *args), timeout, name)
        except ConnectionError:
            if attempt:
                raise
    raise AssertionError("unreachable")


def call_sync(name: str, function: Callable[..., Any], args: tuple = (), timeout: float = 60.0) -> Any:
    return call_async(name, function, args, timeout).wait()


def join(task_type: str, index: int, chief_address: tuple[str, int], *, rpc_timeout: float,
         startup_timeout: float, addresses: Mapping[str, tuple[str, int]], num_threads: int = 16) -> Membership:
    """Join the job as task ``task_type:index``: serve at its address in ``addresses``
    (``{"worker:0": (host, port), ...}``, every task of the cluster) and, unless this is the
    chief, register with the chief at ``chief_address``.

    Raises ``ClusterConfigError`` for a job across hosts without a secret, and whatever the
    connection raises when the chief cannot be reached within ``startup_timeout`` seconds.
    """
    global _node
    key = task_key(task_type, index)
    secret = job_secret.required_secret(chief_address[0], "The parameter-server job")
    is_chief = task_type == "chief"
    node = _Node(CHIEF if is_chief else key, secret or _UNAUTHENTICATED_KEY,
                 {**addresses, "chief:0": chief_address}, num_threads)
    # This task's node before its server accepts a call: a task that registers the moment the
    # chief listens must find it (the entry points read ``_node``).
    with _lock:
        _node = node
    try:
        node.serve(chief_address if is_chief else addresses[key])
    except BaseException:
        leave()
        raise
    if is_chief:
        node.members[key] = CHIEF
        return Membership(node)
    deadline = time.monotonic() + startup_timeout
    while True:
        try:
            node.name = call_sync(CHIEF, _register, (key,), timeout=max(1.0, min(rpc_timeout, startup_timeout)))
            break
        except (OSError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                leave()
                raise
            time.sleep(_CONNECT_RETRY_S)
    if node.server is not None:
        node.server.name = node.name
    return Membership(node)


def leave() -> None:
    """Close this task's server and connections (members may be dead: nobody is asked)."""
    global _node
    with _lock:
        node, _node = _node, None
    if node is not None:
        node.close()


def ping(name: str, timeout: float) -> bool:
    """Whether ``name`` answers a call within ``timeout`` seconds."""
    return probe(name, timeout) is None


def probe(name: str, timeout: float) -> str | None:
    """``None`` when ``name`` answers a call within ``timeout`` seconds; otherwise why not,
    as a short phrase: ``"closed the connection"`` (its process is gone: the connection was
    refused, reset or closed) or ``"stopped answering"`` (no answer in time), with the
    first line of the error."""
    try:
        answered = call_async(name, _pong, timeout=timeout).wait()
    except Exception as error:  # noqa: BLE001 - every failure is a reason
        detail = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        if failure_kind(error) is FailureKind.TIMED_OUT:
            return f"stopped answering ({detail})"
        return f"closed the connection ({detail})"
    return None if answered else "stopped answering (no answer)"


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    end = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(interval)
