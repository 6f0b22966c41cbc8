"""Connecting to the chief's c10d ``TCPStore`` over a link that may lose packets.

A worker connects to the chief's store once at start-up. Over a lossy link a connection
attempt can fail at once ("Connection was likely closed") or stall, though the next would
succeed: ``connect_store`` keeps trying, with a growing random pause between attempts
(0.1 s doubling up to 2 s), until the whole ``seconds`` are spent, each attempt allowed a
third of them (at least 2 s), never all of the time on one attempt.

>>> import datetime, torch.distributed as dist
>>> server = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
>>> client = connect_store("127.0.0.1", server.port, 2, seconds=5)
>>> client.set("k", "v"); server.get("k")
b'v'
"""

from __future__ import annotations

import datetime
import random
import time

import torch.distributed as dist

__all__ = ["connect_store"]

_FIRST_PAUSE_S = 0.1
_LONGEST_PAUSE_S = 2.0
_SHORTEST_ATTEMPT_S = 2.0


def connect_store(host: str, port: int, world_size: int, seconds: float) -> dist.TCPStore:
    """A client of the store at ``host:port``, retried with backoff within ``seconds``.

    Raises:
        the last attempt's error once ``seconds`` have passed.
    """
    deadline = time.monotonic() + seconds
    pause = _FIRST_PAUSE_S
    while True:
        left = deadline - time.monotonic()
        attempt = max(0.1, min(left, max(_SHORTEST_ATTEMPT_S, seconds / 3)))
        try:
            return dist.TCPStore(host, port, world_size, is_master=False,
                                 timeout=datetime.timedelta(seconds=attempt))
        except Exception:  # noqa: BLE001 - retried while time is left, else raised
            if time.monotonic() + pause >= deadline:
                raise
        time.sleep(pause * random.uniform(0.5, 1.0))
        pause = min(2 * pause, _LONGEST_PAUSE_S)
