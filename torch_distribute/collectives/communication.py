"""``CommunicationOptions``: how workers talk (backend, packing, timeouts)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from torch_distribute.errors import InvalidArgumentError

DEFAULT_TIMEOUT_SECONDS = 300.0


class CommunicationImplementation(enum.Enum):
    """Which collective implementation workers use.

    ``AUTO``: NCCL for CUDA tensors, Gloo otherwise. ``RING``: Gloo for everything.
    ``NCCL``: NCCL (CUDA devices only).
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


@dataclass(frozen=True)
class CommunicationOptions:
    """Options for cross-worker collectives.

    ``bytes_per_pack``: gradient bucket size (0: 25 MiB, as DDP). ``timeout_seconds``: the
    longest any collective (and the start-up rendezvous) may wait before raising
    ``WorkerUnavailableError`` naming the missing worker (None: 300 s).
    ``verify_collectives``: before every collective between workers (reductions, gathers,
    broadcasts, the per-step input agreement) the workers compare what they are about to
    call (purpose, dtype, shape), and every gradient bucket carries the optimizer step and
    ``run`` number it belongs to; a difference raises ``ReplicaMismatchError`` on every
    worker, naming what each called, instead of mixing unrelated tensors or aborting inside
    Gloo/NCCL. It costs one small extra exchange per reduction and per optimizer step (not
    per gradient bucket); ``False`` turns the exchanges off (the buckets' signature stays: it
    costs nothing).

    >>> CommunicationOptions(timeout_seconds=30).timeout_seconds
    30
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO
    verify_collectives: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.bytes_per_pack, int) or self.bytes_per_pack < 0:
            raise InvalidArgumentError(f"bytes_per_pack must be an int >= 0, got {self.bytes_per_pack!r}.")
        if self.timeout_seconds is not None and not self.timeout_seconds > 0:
            raise InvalidArgumentError(f"timeout_seconds must be > 0 or None, got {self.timeout_seconds!r}.")
        if not isinstance(self.verify_collectives, bool):
            raise InvalidArgumentError(
                f"verify_collectives must be True or False, got {self.verify_collectives!r}."
            )
        if not isinstance(self.implementation, CommunicationImplementation):
            raise InvalidArgumentError(
                f"implementation must be a td.CommunicationImplementation, got {self.implementation!r}."
            )

    @property
    def timeout(self) -> float:
        return DEFAULT_TIMEOUT_SECONDS if self.timeout_seconds is None else float(self.timeout_seconds)

    @property
    def bucket_bytes(self) -> int:
        return self.bytes_per_pack or 25 * 1024 * 1024
