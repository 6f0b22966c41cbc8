"""``Membership``: where this process stands in a ``WorkerGroup``, shared by the group's parts.

Its rank of the job's ``world_size`` workers, the address of the chief's store (a chief that
adopts an existing process group picks the port, so the rendezvous may change it once), and
the deadlines every part applies, all derived from ``CommunicationOptions.timeout``.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass


@dataclass
class Membership:
    """This worker's rank, the chief's store address and the group's deadlines.

    Public surface: ``host``, ``port`` (written by the rendezvous only), ``world_size``,
    ``rank``, ``timeout`` (seconds), and the derived ``collective_timeout``,
    ``heartbeat_interval``, ``store_deadline`` and ``store_address``.

    >>> member = Membership("127.0.0.1", 29500, world_size=2, rank=1, timeout=30.0)
    >>> member.store_address, member.heartbeat_interval, member.store_deadline
    ('127.0.0.1:29500', 5.0, 5.0)
    """

    host: str
    port: int
    world_size: int
    rank: int
    timeout: float  # seconds any collective or store access may wait

    @property
    def collective_timeout(self) -> datetime.timedelta:
        """``timeout`` as torch's process groups and stores take it."""
        return datetime.timedelta(seconds=self.timeout)

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between two heartbeats of this worker."""
        return max(0.5, min(5.0, self.timeout / 6))

    @property
    def store_deadline(self) -> float:
        """How long the store may take to answer a probe before the chief counts as unreachable
        (its server is a C++ thread: it answers at once unless the chief is stopped or cut off)."""
        return min(5.0, self.heartbeat_interval)

    @property
    def store_address(self) -> str:
        """``host:port`` of the chief's store."""
        return f"{self.host}:{self.port}"
