"""A reconfigurable Gloo process group whose every member proves the job secret first.

torchft's ``ProcessGroupGloo`` is made again for every quorum, over a c10d store prefix that
quorum alone uses. Anyone who reaches torchft's lighthouse can take part in a quorum, so
before the Gloo group is made the members run this job's challenge and response through
that store (``job_auth.authenticate``: rank 0 checks every other rank's HMAC of its
challenge, and answers each rank's own nonce, so both sides are proven). A member without
the secret makes the configuration fail on every member (``JobAuthenticationError``, logged
on ``torch_distribute.security``; torchft then drops the step): no Gloo link to it is opened, so no gradient and no
recovered state (torchft's ``PGTransport`` sends state over this group) ever reaches it.

torchft is imported by ``authenticated_gloo()``, not by importing this module (importing it
changes torch's state: ``tests/test_torch_untouched.py``).

>>> # pg = authenticated_gloo(secret=b"0123456789abcdef", timeout=datetime.timedelta(seconds=30))
>>> # pg.configure("127.0.0.1:29600/torchft/1/0", "td00000", rank=0, world_size=2)
"""

from __future__ import annotations

import datetime
import functools
from typing import Any

from torch_distribute.collectives import job_auth

__all__ = ["authenticated_gloo"]


def authenticated_gloo(secret: bytes | None, timeout: datetime.timedelta) -> Any:
    """torchft's reconfigurable Gloo group, made only among holders of ``secret``.

    ``secret`` None: the job runs unauthenticated (``job_secret.required_secret`` decided
    so and warned); the proof is skipped by every member alike. The group also records the
    quorum it was last made for (``quorum_id``) and its members' worker slots in rank order
    (``members``).
    """
    return _group_class()(secret, timeout)


@functools.cache
def _group_class() -> type:
    from torchft.process_group import ProcessGroupGloo

    class AuthenticatedGloo(ProcessGroupGloo):  # type: ignore[misc]
        def __init__(self, secret: bytes | None, timeout: datetime.timedelta) -> None:
            super().__init__(timeout=timeout)
            self._secret = secret
            self.quorum_id = -1
            self.members: tuple[int, ...] = ()

        def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                      quorum_id: int | None = None, group_rank: int | None = None,
                      group_world_size: int | None = None, global_ranks: list[int] | None = None) -> None:
            self.quorum_id = -1 if quorum_id is None else int(quorum_id)
            self.members = tuple(global_ranks) if global_ranks is not None else tuple(range(world_size))
            super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank,
                              group_world_size, global_ranks)

        def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
            job_auth.authenticate(store, rank, world_size, self._secret,
                                  "the fault-tolerant quorum's store", self._timeout.total_seconds())
            return super()._create_pg(store, rank, world_size)

    return AuthenticatedGloo
