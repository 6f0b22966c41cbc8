"""``FingerprintAgreement``: every collective between workers compared across them first.

Each worker's fingerprint of the collective it is about to make (``fingerprint.py``: what,
kind, dtype, shape) travels in one all-gather, in rows packed and read by ``exchange.py``, so a
program that calls different collectives on different workers gets ``ReplicaMismatchError``
naming each worker's call rather than mixed numbers. A small payload may ride in the same row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, NoReturn

import torch
import torch.distributed as dist

from torch_distribute.collectives import exchange, fingerprint
from torch_distribute.collectives.failure_diagnosis import FailureDiagnosis
from torch_distribute.collectives.membership import Membership
from torch_distribute.collectives.process_groups import ProcessGroups
from torch_distribute.errors import ReplicaMismatchError
from torch_distribute.log import get_logger

_log = get_logger("collectives")


class Agreement(NamedTuple):
    """A fingerprint exchange in flight (``WorkerGroup.start_agreement``): the all-gather of
    every worker's row (``exchange.pack``: this worker's fingerprint is ``head``) into the
    rows of ``gathered``."""

    work: dist.Work
    gathered: torch.Tensor
    head: bytes
    what: str
    dtype: torch.dtype | None
    shape: Sequence[int] | None


class FingerprintAgreement:
    """The fingerprint exchanges of one group, and the count of its collectives.

    Public surface: ``verifies`` (``CommunicationOptions.verify_collectives``), ``collectives``
    (how many were made on the main group) and ``count()`` (one more, unfingerprinted),
    ``agree``/``start``/``finish`` (a fingerprint alone), ``start_exchange``/``finish_exchange``
    (a fingerprint with a payload) and ``raise_mismatch``.

    >>> # agreement = FingerprintAgreement(membership, groups, diagnosis, verify=True)
    >>> # agreement.agree("all_reduce SUM", "reduce", tensor)  # ReplicaMismatchError if they differ
    """

    def __init__(self, membership: Membership, groups: ProcessGroups, diagnosis: FailureDiagnosis,
                 verify: bool) -> None:
        self._member = membership
        self._groups = groups
        self._diagnosis = diagnosis
        self._verify = verify
        self.collectives = 0  # collectives on the main group, fingerprinted or not

    @property
    def verifies(self) -> bool:
        """Whether collectives are fingerprinted (``CommunicationOptions.verify_collectives``)."""
        return self._verify

    def count(self) -> None:
        """Count one collective made without a fingerprint."""
        self.collectives += 1

    def agree(self, kind: str, what: str, tensor: torch.Tensor | None = None,
              shape: Sequence[int] | None = None) -> None:
        """Check that every worker is about to make the same collective (when verifying)."""
        agreement = self.start(kind, what, tensor, shape)
        if agreement is not None:
            self.finish(agreement)

    def start(self, kind: str, what: str, tensor: torch.Tensor | None = None,
              shape: Sequence[int] | None = None) -> Agreement | None:
        """``agree`` in two halves: start the exchange now. None when not verifying."""
        _log.debug("collective #%d: %s (%s)", self.collectives + 1, what, kind)
        if not self._verify:
            self.collectives += 1
            return None
        dtype = tensor.dtype if tensor is not None else None
        own_shape = tuple(tensor.shape) if tensor is not None else None
        return self.start_exchange(kind, what, dtype, own_shape,
                                   compared=tuple(shape) if shape is not None else None)

    def finish(self, agreement: Agreement) -> None:
        """Wait for an exchange ``start`` began; raise if the workers differ."""
        self.finish_exchange(agreement)

    def start_exchange(self, kind: str, what: str, dtype: torch.dtype | None, shape: Sequence[int] | None,
                       payload: bytes = b"", compared: Sequence[int] | None = None) -> Agreement:
        """Start one all-gather of this collective's fingerprint (of ``compared``, or of
        ``shape``) followed by ``payload`` (``exchange.py``). An all-gather: Gloo's all-reduce
        of more than one element costs about twice as much. Called on the process group
        itself: ``dist.all_gather``'s checks and logging cost more than the rest of the
        exchange, and the row is well-formed by construction."""
        self.collectives += 1
        head = fingerprint.encode(kind, what, dtype, compared if compared is not None else shape)
        gathered = torch.empty(self._member.world_size, exchange.WIDTH, dtype=torch.int64)
        try:
            work = self._groups.main.allgather([list(gathered.unbind(0))], [exchange.pack(head, payload)])
        except Exception as error:  # noqa: BLE001 - translated with the missing worker's name
            raise self._diagnosis.describe_failure(what, error) from error
        return Agreement(work, gathered, head, what, dtype, shape)

    def finish_exchange(self, agreement: Agreement) -> list[bytes]:
        """Wait for an exchange; every worker's payload, or ``ReplicaMismatchError`` on every
        worker."""
        self._diagnosis.wait(agreement.what, lambda: agreement.work)
        rows = exchange.rows(agreement.gathered)
        if any(head != agreement.head for head, _ in rows):
            self.raise_mismatch(fingerprint.describe(agreement.what, agreement.dtype, agreement.shape))
        return [payload for _, payload in rows]

    def raise_mismatch(self, description: str) -> NoReturn:
        """Every worker found a mismatch in the same collective: exchange what each called and
        raise ``ReplicaMismatchError`` naming them (on every worker)."""
        self._diagnosis.mark_failed()
        member = self._member
        mine = f"{description} at {fingerprint.call_site()}"
        calls: list[object] = [None] * member.world_size
        self._diagnosis.wait("the exchange of mismatched collectives",
                             lambda: dist.all_gather_object(calls, mine, group=self._groups.main))
        listing = "; ".join(f"worker {rank}: {call}" for rank, call in enumerate(calls))
        raise ReplicaMismatchError(
            f"The workers called different collectives at the same point (collective "
            f"#{self.collectives} of worker {member.rank}): {listing}. Every worker must make the same "
            "reductions, gathers, saves and optimizer steps, in the same order and with tensors of "
            "the same dtype and shape (look for one inside an `if` on the worker index, or for "
            "workers with different amounts of data)."
        )
