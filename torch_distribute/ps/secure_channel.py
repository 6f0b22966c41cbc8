"""An authenticated call channel: only peers holding the job secret, only named entry points.

The transport the parameter-server tasks are moving to (docs/security.md): a TCP connection
per peer pair on which

1. both ends prove the job secret before anything else (HMAC-SHA256 challenge-response with
   a nonce from each side; the secret never travels): a peer that cannot is logged on
   ``torch_distribute.security`` and dropped;
2. every message carries ``HMAC-SHA256(session key, direction | sequence number | body)``
   (the session key derived from the secret and both nonces), checked before any byte of it
   is parsed, so a forged, altered, replayed or reordered message closes the connection;
3. a request names an *entry point* by string; only those the server registered can be
   called, and the arguments are unpickled (``cloudpickle``'s format, so closures and lambdas
   travel) only after the MAC and the name are checked.

Why this and not gRPC+TLS or ZeroMQ CURVE: both would add a dependency, a certificate or key
pair per task to distribute, and a second serialization layer to keep closures travelling;
the threat here (outsiders without the secret) needs authentication and integrity, which
HMAC over a shared secret gives with the standard library alone. Confidentiality is not
provided: run jobs across hosts on a network you control (as for Gloo).

>>> import secrets
>>> secret = secrets.token_bytes(32)
>>> server = ChannelServer(("127.0.0.1", 0), secret, {"add": lambda a, b: a + b}, name="ps:0")
>>> client = ChannelClient(server.address, secret, name="worker:0")
>>> client.call("add", 2, 3, timeout=10)
5
>>> client.close(); server.close()
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import hmac
import itertools
import json
import logging
import pickle
import secrets
import socket
import struct
import threading
from collections.abc import Callable, Mapping
from typing import Any

import cloudpickle

from torch_distribute.errors import DistributeError, JobAuthenticationError

__all__ = ["ChannelClient", "ChannelServer", "RemoteCallError"]

logger = logging.getLogger("torch_distribute.security")

_MAGIC = b"TDCH1"
_NONCE = 32
_MAC = 32
_HANDSHAKE_S = 10.0
_MAX_FRAME = 1 << 31


class RemoteCallError(DistributeError, RuntimeError):
    """A call the server refused (an unknown entry point) or that raised there."""


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"|".join(parts), hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class ForgedMessageError(ConnectionError):
    """A message whose MAC is wrong: forged, altered, replayed or reordered.

    >>> issubclass(ForgedMessageError, ConnectionError)
    True
    """


class _Session:
    """One authenticated connection: framed, MAC'd messages in each direction."""

    def __init__(self, sock: socket.socket, key: bytes, outgoing: bytes, incoming: bytes):
        self.sock = sock
        self._key = key
        self._out, self._in = outgoing, incoming
        self._sent = itertools.count()
        self._received = itertools.count()
        self._send_lock = threading.Lock()

    def send(self, header: Mapping[str, Any], payload: bytes = b"") -> None:
        head = json.dumps(header).encode()
        body = struct.pack("!I", len(head)) + head + payload
        with self._send_lock:
            sequence = struct.pack("!Q", next(self._sent))
            self.sock.sendall(struct.pack("!Q", len(body)) + _mac(self._key, self._out, sequence, body) + body)

    def receive(self) -> tuple[dict[str, Any], bytes]:
        """The next message; ``ConnectionError`` for a closed connection or a wrong MAC."""
        size = struct.unpack("!Q", _recv_exactly(self.sock, 8))[0]
        if size > _MAX_FRAME:
            raise ConnectionError(f"a frame of {size} bytes")
        mac = _recv_exactly(self.sock, _MAC)
        body = _recv_exactly(self.sock, size)
        sequence = struct.pack("!Q", next(self._received))
        if not hmac.compare_digest(mac, _mac(self._key, self._in, sequence, body)):
            raise ForgedMessageError("a message whose MAC is wrong (forged, altered, replayed or reordered)")
        head_size = struct.unpack("!I", body[:4])[0]
        return json.loads(body[4:4 + head_size]), body[4 + head_size:]

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _server_handshake(sock: socket.socket, secret: bytes) -> _Session:
    ours = secrets.token_bytes(_NONCE)
    sock.sendall(_MAGIC + ours)
    answer = _recv_exactly(sock, _NONCE + _MAC)
    theirs, proof = answer[:_NONCE], answer[_NONCE:]
    if not hmac.compare_digest(proof, _mac(secret, b"client", ours, theirs)):
        raise JobAuthenticationError("it did not prove the job secret")
    sock.sendall(_mac(secret, b"server", ours, theirs))
    return _Session(sock, _mac(secret, b"session", ours, theirs), b"s", b"c")


def _client_handshake(sock: socket.socket, secret: bytes) -> _Session:
    greeting = _recv_exactly(sock, len(_MAGIC) + _NONCE)
    if not greeting.startswith(_MAGIC):
        raise JobAuthenticationError("the server does not speak this protocol")
    theirs, ours = greeting[len(_MAGIC):], secrets.token_bytes(_NONCE)
    sock.sendall(ours + _mac(secret, b"client", theirs, ours))
    try:
        proof = _recv_exactly(sock, _MAC)
    except ConnectionError:
        raise JobAuthenticationError("the server refused this process's proof of the job secret") from None
    if not hmac.compare_digest(proof, _mac(secret, b"server", theirs, ours)):
        raise JobAuthenticationError("the server did not prove the job secret")
    return _Session(sock, _mac(secret, b"session", theirs, ours), b"c", b"s")


class ChannelServer:
    """Serve ``entry_points`` (``{name: function}``) at ``address`` to peers holding ``secret``.

    ``name`` (``"ps:0"``) appears in the log lines about refused peers. Each request runs
    in a pool of ``num_threads`` threads.
    """

    def __init__(self, address: tuple[str, int], secret: bytes, entry_points: Mapping[str, Callable[..., Any]],
                 *, name: str, num_threads: int = 16):
        self._secret = secret
        self._entry_points = dict(entry_points)
        self.name = name
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(address)
        self._listener.listen(128)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._pool = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix=f"td-{name}")
        self._closed = threading.Event()
        self._sessions: set[_Session] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name=f"td-{name}-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock, peer), daemon=True).start()

    def _serve(self, sock: socket.socket, peer: Any) -> None:
        try:
            sock.settimeout(_HANDSHAKE_S)
            session = _server_handshake(sock, self._secret)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, ConnectionError, JobAuthenticationError) as error:
            logger.warning("%s refused a connection from %s: %s.", self.name, peer, error)
            sock.close()
            return
        with self._lock:
            self._sessions.add(session)
        try:
            while True:
                header, payload = session.receive()
                if self._closed.is_set():
                    return
                self._pool.submit(self._handle, session, header, payload, peer)
        except (OSError, ConnectionError, RuntimeError) as error:  # RuntimeError: the pool closed
            if isinstance(error, ForgedMessageError):
                logger.warning("%s closed its connection from %s: %s.", self.name, peer, error)
        finally:
            with self._lock:
                self._sessions.discard(session)
            session.close()

    def _handle(self, session: _Session, header: dict[str, Any], payload: bytes, peer: Any) -> None:
        call_id, entry = header.get("id"), header.get("entry")
        function = self._entry_points.get(entry) if isinstance(entry, str) else None
        try:
            if function is None:
                logger.warning("%s refused a call from %s to %r: not one of its entry points.",
                               self.name, peer, entry)
                raise RemoteCallError(f"{self.name} has no entry point {entry!r}; it serves "
                                      f"{sorted(self._entry_points)}.")
            args, kwargs = pickle.loads(payload)  # authenticated peer, allowed entry point
            reply, ok = function(*args, **kwargs), True
        except BaseException as error:  # noqa: BLE001 - sent back to the caller
            reply, ok = error, False
        try:
            data = cloudpickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as error:  # noqa: BLE001 - an unpicklable result or error
            data, ok = cloudpickle.dumps(RemoteCallError(f"{entry}: {type(error).__name__}: {error}")), False
        try:
            session.send({"id": call_id, "ok": ok}, data)
        except OSError:
            pass  # the caller is gone

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            sessions = list(self._sessions)
        for session in sessions:
            session.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class ChannelClient:
    """A connection to a ``ChannelServer``; ``call_async`` returns a ``concurrent.futures.Future``.

    Raises ``JobAuthenticationError`` when the server and this process do not share the
    secret (either side refusing), ``OSError`` when the server cannot be reached.
    """

    def __init__(self, address: tuple[str, int], secret: bytes, *, name: str, connect_timeout: float = _HANDSHAKE_S):
        self.name = name
        sock = socket.create_connection(address, timeout=connect_timeout)
        try:
            self._session = _client_handshake(sock, secret)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._ids = itertools.count()
        self._pending: dict[int, concurrent.futures.Future[Any]] = {}
        self._lock = threading.Lock()
        self._failure: BaseException | None = None
        threading.Thread(target=self._read_replies, name=f"td-{name}-replies", daemon=True).start()

    def _read_replies(self) -> None:
        try:
            while True:
                header, payload = self._session.receive()
                with self._lock:
                    future = self._pending.pop(int(header.get("id", -1)), None)
                if future is None:
                    continue
                value = pickle.loads(payload)  # from the authenticated server, MAC checked
                if header.get("ok"):
                    future.set_result(value)
                else:
                    future.set_exception(value)
        except (OSError, ConnectionError) as error:
            with self._lock:
                self._failure = error
                pending, self._pending = self._pending, {}
            for future in pending.values():
                future.set_exception(ConnectionError(f"the connection closed ({error})"))

    @property
    def alive(self) -> bool:
        """Whether the connection is still open (no failure read yet)."""
        return self._failure is None

    def call_async(self, entry: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        """Call the server's entry point ``entry`` with ``args``/``kwargs`` (sent by value)."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        payload = cloudpickle.dumps((args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if self._failure is not None:
                raise ConnectionError(f"the connection closed ({self._failure})")
            call_id = next(self._ids)
            self._pending[call_id] = future
        self._session.send({"id": call_id, "entry": entry}, payload)
        return future

    def call(self, entry: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        return self.call_async(entry, *args, **kwargs).result(timeout)

    def close(self) -> None:
        self._session.close()
