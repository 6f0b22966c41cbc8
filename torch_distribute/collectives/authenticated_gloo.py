"""A reconfigurable Gloo process group whose every member proves the job secret first.

torchft's ``ProcessGroupGloo`` is made again for every quorum, over a c10d store prefix that
quorum alone uses. Anyone who reaches torchft's lighthouse can take part in a quorum, so
before the Gloo group is made the members run this job's challenge and response through
that store (``job_auth.authenticate``: rank 0 checks every other rank's HMAC of its
challenge, and answers each rank's own nonce, so both sides are proven). A member without
the secret makes the configuration fail on every member (``JobAuthenticationError``, logged
on ``torch_distribute.security``): no Gloo link to it is opened, so no gradient and no
recovered state (torchft's ``PGTransport`` sends state over this group) ever reaches it.

Importing this module imports torchft (``fault_tolerant_group.require_torchft`` first).

>>> # pg = AuthenticatedGloo(secret=b"0123456789abcdef", timeout=datetime.timedelta(seconds=30))
>>> # pg.configure("127.0.0.1:29600/torchft/1/0", "td00000", rank=0, world_size=2)
"""

from __future__ import annotations

import datetime
from typing import Any

from torchft.process_group import ProcessGroupGloo

from torch_distribute.collectives import job_auth
from torch_distribute.errors import JobAuthenticationError

__all__ = ["AuthenticatedGloo"]


class AuthenticatedGloo(ProcessGroupGloo):
    """torchft's reconfigurable Gloo group, made only among holders of ``secret``.

    ``secret`` None: the job runs unauthenticated (``job_secret.required_secret`` decided
    so and warned); the proof is skipped by every member alike.
    """

    def __init__(self, secret: bytes | None, timeout: datetime.timedelta) -> None:
        super().__init__(timeout=timeout)
        self._secret = secret
        self.authentication_failures = 0  # consecutive configurations refused at the proof
        self.quorum_id = -1  # the quorum the group was last made for
        self.members: tuple[int, ...] = ()  # its members' global ranks (worker slots), rank order

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  quorum_id: int | None = None, group_rank: int | None = None,
                  group_world_size: int | None = None, global_ranks: list[int] | None = None) -> None:
        """torchft's reconfiguration, remembering which quorum and which members it was for."""
        self.quorum_id = -1 if quorum_id is None else int(quorum_id)
        self.members = tuple(global_ranks) if global_ranks is not None else tuple(range(world_size))
        super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank,
                          group_world_size, global_ranks)

    def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
        try:
            job_auth.authenticate(store, rank, world_size, self._secret,
                                  "the fault-tolerant quorum's store", self._timeout.total_seconds())
        except JobAuthenticationError:
            self.authentication_failures += 1
            raise
        self.authentication_failures = 0
        return super()._create_pg(store, rank, world_size)
