"""``GroupCollectives``: the collectives of a ``WorkerGroup`` on its process groups.

Reductions, gathers and broadcasts of tensors (packed ones too), small Python objects, a flag
on any worker, and the gradient buckets' asynchronous all-reduce. Each waits at most the
deadline and names the missing worker (``FailureDiagnosis.wait``), and each but the gradient
buckets is fingerprinted first (``FingerprintAgreement``); a small tensor travels inside its
fingerprint's exchange.
"""

from __future__ import annotations

import struct
from typing import Any

import torch
import torch.distributed as dist

from torch_distribute.collectives import exchange
from torch_distribute.collectives.agreement import FingerprintAgreement
from torch_distribute.collectives.failure_diagnosis import FailureDiagnosis
from torch_distribute.collectives.membership import Membership
from torch_distribute.collectives.packing import apply_packed_, joined_along, padded_along
from torch_distribute.collectives.process_groups import ProcessGroups
from torch_distribute.log import get_logger

_log = get_logger("collectives")


class GroupCollectives:
    """The collectives between the workers, with ``WorkerGroup``'s signatures.

    Public surface: ``any_true``, ``gather_small``, ``all_reduce_``, ``broadcast_``, ``all_gather_objects``,
    ``all_gather_along``, ``broadcast_packed_``, ``average_packed_`` and
    ``all_reduce_async`` (finished with ``FailureDiagnosis.wait``).

    >>> # collectives = GroupCollectives(membership, groups, agreement, diagnosis)
    >>> # collectives.all_reduce_(torch.ones(3), what="loss")  # tensor([2., 2., 2.]) on 2 workers
    """

    def __init__(self, membership: Membership, groups: ProcessGroups, agreement: FingerprintAgreement,
                 diagnosis: FailureDiagnosis) -> None:
        self._member = membership
        self._groups = groups
        self._agreement = agreement
        self._diagnosis = diagnosis

    def any_true(self, flag: bool, what: str) -> bool:
        """Whether ``flag`` is true on any worker: one collective, the fingerprint included."""
        if not self._agreement.verifies:
            self._agreement.count()
            mine = torch.tensor([int(flag)])
            self._diagnosis.wait(what, lambda: dist.all_reduce(mine, group=self._groups.main, async_op=True))
            return bool(mine[0] > 0)
        agreement = self._agreement.start_exchange("any_true", what, None, None, b"\x01" if flag else b"\x00")
        return any(payload[0] for payload in self._agreement.finish_exchange(agreement))

    def gather_small(self, payload: bytes, what: str) -> list[bytes]:
        """Every worker's ``payload`` (at most ``exchange.PAYLOAD_BYTES``), in rank order, each
        zero-padded to that size: one collective, the fingerprint included."""
        if len(payload) > exchange.PAYLOAD_BYTES:
            raise ValueError(f"gather_small carries at most {exchange.PAYLOAD_BYTES} bytes, got {len(payload)}.")
        if self._agreement.verifies:
            agreement = self._agreement.start_exchange("gather_small", what, None, None, payload)
            return self._agreement.finish_exchange(agreement)
        self._agreement.count()
        mine = exchange.pack(b"", payload)[: exchange.SMALL]
        everyone = [torch.empty_like(mine) for _ in range(self._member.world_size)]
        self._diagnosis.wait(what, lambda: dist.all_gather(everyone, mine, group=self._groups.main, async_op=True))
        return [row.numpy().tobytes() for row in everyone]

    def all_reduce_(self, tensor: torch.Tensor, op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                    what: str = "all_reduce") -> torch.Tensor:
        """In-place SUM (or ``op``) over workers of a tensor on a backend-compatible device.

        A small tensor (a loss, a metric's totals) travels inside its fingerprint's exchange
        and is combined here, in rank order: one collective instead of two.
        """
        if self._agreement.verifies and exchange.can_carry(tensor, op):
            agreement = self._agreement.start_exchange(f"all_reduce {op}", what, tensor.dtype, tuple(tensor.shape),
                                                       exchange.small_values(tensor))
            return tensor.copy_(exchange.combine(self._agreement.finish_exchange(agreement), op, tensor))
        self._agreement.agree(f"all_reduce {op}", what, tensor)
        target = self._comm_tensor(tensor)
        self._diagnosis.wait(what, lambda: dist.all_reduce(target, op=op, group=self._groups.main, async_op=True))
        if target is not tensor:
            tensor.copy_(target)
        return tensor

    def broadcast_(self, tensor: torch.Tensor, src: int = 0, what: str = "broadcast") -> torch.Tensor:
        """Replace ``tensor`` in place by worker ``src``'s."""
        self._agreement.agree(f"broadcast from {src}", what, tensor)
        target = self._comm_tensor(tensor)
        self._diagnosis.wait(what, lambda: dist.broadcast(target, src=src, group=self._groups.main, async_op=True))
        if target is not tensor:
            tensor.copy_(target)
        return tensor

    def all_gather_objects(self, value: Any, what: str = "all_gather") -> list[Any]:
        """Small Python values from every worker, in rank order (start-up checks only): any
        picklable value, as the caller's own code reads it."""
        self._agreement.agree("all_gather_objects", what)
        out: list[Any] = [None] * self._member.world_size
        self._diagnosis.wait(what, lambda: dist.all_gather_object(out, value, group=self._groups.main))
        return out

    def all_gather_along(self, tensor: torch.Tensor, axis: int, what: str = "gather") -> torch.Tensor:
        """Concatenate ``tensor`` from every worker along ``axis`` (sizes may differ)."""
        world_size = self._member.world_size
        off_axis = tuple(-1 if d == axis else n for d, n in enumerate(tensor.shape))
        sizes = torch.tensor([tensor.shape[axis]], dtype=torch.int64)
        if self._agreement.verifies:  # the sizes travel with the fingerprint
            agreement = self._agreement.start_exchange(
                f"all_gather along {axis}", what, tensor.dtype, tuple(tensor.shape),
                struct.pack("<q", tensor.shape[axis]), compared=off_axis)
            counts = [struct.unpack_from("<q", payload)[0] for payload in self._agreement.finish_exchange(agreement)]
        else:
            self._agreement.count()
            all_sizes = [torch.zeros_like(sizes) for _ in range(world_size)]
            self._diagnosis.wait(what, lambda: dist.all_gather(all_sizes, sizes, group=self._groups.main, async_op=True))
            counts = [int(s[0]) for s in all_sizes]
        padded = self._comm_tensor(padded_along(tensor, axis, max(counts)))
        pieces = [torch.empty_like(padded) for _ in range(world_size)]
        self._diagnosis.wait(what, lambda: dist.all_gather(pieces, padded, group=self._groups.main, async_op=True))
        return joined_along(pieces, counts, axis, tensor.device)

    def broadcast_packed_(self, tensors: list[torch.Tensor], src: int = 0, what: str = "broadcast") -> None:
        """Broadcast ``tensors`` from worker ``src`` in place, packed into few buffers."""
        apply_packed_(tensors, lambda flat: self.broadcast_(flat, src=src, what=what))

    def average_packed_(self, tensors: list[torch.Tensor], what: str = "average") -> None:
        """Replace ``tensors`` in place by their mean over the workers, packed."""
        apply_packed_(tensors, lambda flat: self.all_reduce_(flat, what=what).div_(self._member.world_size))

    def all_reduce_async(self, tensor: torch.Tensor) -> dist.Work | None:
        """Start a SUM of ``tensor`` over the workers on the gradient group (never interleaved
        with other collectives); finish it with ``FailureDiagnosis.wait``."""
        _log.debug("gradient bucket all-reduce (%d values) on the gradient group", tensor.numel())
        return dist.all_reduce(tensor, group=self._groups.gradient, async_op=True)

    def _comm_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_cuda and not self._groups.uses_nccl:
            return tensor.cpu()
        return tensor
