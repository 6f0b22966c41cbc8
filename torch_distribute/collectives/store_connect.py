"""Connecting to the chief's c10d ``TCPStore`` over a link that may lose packets.

A worker connects to the chief's store once at start-up. Over a lossy link a connection
attempt can fail at once ("Connection was likely closed") or stall, though the next would
succeed: ``connect_store`` keeps trying, with a growing random pause between attempts
(0.1 s doubling up to 2 s), until the whole ``seconds`` are spent, each attempt allowed a
third of them (at least 2 s, at most 5 s), never all of the time on one attempt.

A worker started before its chief (or whose chief is unreachable) says so, as the chief says
which workers it waits for (``rendezvous_views.py``): given ``waiting=`` (who waits, e.g.
``"worker 1 of 2"``), a WARNING on the ``torch_distribute.collectives`` logger names the
address it tries and since when, ``FIRST_REPORT_S`` seconds after the first attempt and then
every ``rendezvous_views.PROGRESS_INTERVAL_S`` seconds::

    worker 1 of 2: waiting for the chief (worker 0) at 127.0.0.1:29500 since 17:20:05 (5 s):
    it does not answer yet (...); giving up at 17:25:05

>>> import datetime, torch.distributed as dist
>>> server = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
>>> client = connect_store("127.0.0.1", server.port, 2, seconds=5)
>>> client.set("k", "v"); server.get("k")
b'v'
"""

from __future__ import annotations

import datetime
import logging
import random
import time

import torch.distributed as dist

from torch_distribute.collectives import rendezvous_views

__all__ = ["FIRST_REPORT_S", "connect_store"]

logger = logging.getLogger("torch_distribute.collectives")

#: Seconds a worker waits for the chief's store before it first says so.
FIRST_REPORT_S = 5.0
_FIRST_PAUSE_S = 0.1
_LONGEST_PAUSE_S = 2.0
_SHORTEST_ATTEMPT_S = 2.0
#: An attempt blocks (torch retries inside it): short enough that the waiting line is on time.
_LONGEST_ATTEMPT_S = 5.0


def connect_store(host: str, port: int, world_size: int, seconds: float,
                  waiting: str | None = None) -> dist.TCPStore:
    """A client of the store at ``host:port``, retried with backoff within ``seconds``.

    ``waiting``: who connects (``"worker 1 of 2"``); while the store does not answer, a line
    says who waits for the chief, at which address and since when (see the module docstring).

    Raises:
        the last attempt's error once ``seconds`` have passed.
    """
    started = time.monotonic()
    since = datetime.datetime.now()
    deadline = started + seconds
    next_report = started + FIRST_REPORT_S
    pause = _FIRST_PAUSE_S
    while True:
        left = deadline - time.monotonic()
        attempt = max(0.1, min(left, max(_SHORTEST_ATTEMPT_S, min(seconds / 3, _LONGEST_ATTEMPT_S))))
        try:
            return dist.TCPStore(host, port, world_size, is_master=False,
                                 timeout=datetime.timedelta(seconds=attempt))
        except Exception as error:  # noqa: BLE001 - retried while time is left, else raised
            if time.monotonic() + pause >= deadline:
                raise
            now = time.monotonic()
            if waiting is not None and now >= next_report:
                next_report = now + rendezvous_views.PROGRESS_INTERVAL_S
                reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                logger.warning(
                    "%s: waiting for the chief (worker 0) at %s:%d since %s (%.0f s): it does not answer "
                    "yet (%s); giving up at %s", waiting, host, port, since.strftime("%H:%M:%S"), now - started,
                    reason[:200], (since + datetime.timedelta(seconds=seconds)).strftime("%H:%M:%S"))
        time.sleep(pause * random.uniform(0.5, 1.0))
        pause = min(2 * pause, _LONGEST_PAUSE_S)
