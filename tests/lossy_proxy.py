"""A userspace TCP forwarder that loses connection attempts, for start-up over a lossy link.

Where the kernel has no ``netem``, this stands in for a link that drops packets: for the
first ``refuse_for`` seconds after its first connection it accepts and at once closes every
connection (a lost handshake, as the client sees it), and afterwards it closes each new
connection with probability ``drop`` and delays the others by up to ``delay`` seconds
before forwarding both ways. No pytest and no torch here.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time


class LossyProxy:
    """Forwards ``127.0.0.1:port`` (a free port) to ``target``; ``close()`` stops it."""

    def __init__(self, target: tuple[str, int], refuse_for: float = 0.0, drop: float = 0.0,
                 delay: float = 0.0, seed: int = 0) -> None:
        self.target = target
        self.refuse_for, self.drop, self.delay = refuse_for, drop, delay
        self.random = random.Random(seed)
        self.dropped = 0
        self.forwarded = 0
        self._first: float | None = None
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            now = time.monotonic()
            self._first = now if self._first is None else self._first
            if now - self._first < self.refuse_for or self.random.random() < self.drop:
                self.dropped += 1
                with contextlib.suppress(OSError):
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
                client.close()
                continue
            pause = self.random.uniform(0, self.delay)
            threading.Thread(target=self._forward, args=(client, pause), daemon=True).start()

    def _forward(self, client: socket.socket, pause: float) -> None:
        time.sleep(pause)
        try:
            upstream = socket.create_connection(self.target, timeout=10)
            upstream.settimeout(None)
        except OSError:
            client.close()
            return
        self.forwarded += 1
        for source, sink in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(source, sink), daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while True:
            data = source.recv(65536)
            if not data:
                break
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
