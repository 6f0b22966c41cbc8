"""In-process cross-device ops: how replicas of one process combine their tensors.

``ReductionToOneDevice`` copies everything to one device and sums there;
``HierarchicalCopyAllReduce`` sums pairwise down a tree of devices; ``NcclAllReduce`` uses
NCCL between the GPUs of this process. All of them pack many small tensors into a few flat
buffers first (``num_packs``), so a model's gradients cost a handful of kernels, not one per
parameter. Summation order is fixed (replica order), so results are reproducible.

>>> import torch
>>> ops = ReductionToOneDevice()
>>> ops.reduce("sum", [torch.tensor(1.0), torch.tensor(2.0)], torch.device("cpu"))
tensor(3.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torch_distribute.collectives.arithmetic import divide
from torch_distribute.collectives.packing import pack, packs_by_dtype, unpack
from torch_distribute.devices import LogicalDevice, canonicalize, share_a_gpu
from torch_distribute.errors import InvalidArgumentError, InvalidDeviceError
from torch_distribute.reduce_op import ReduceOp
from torch_distribute.values import check_same_layout


class CrossDeviceOps:
    """Base class: reduce / all-reduce / broadcast across the replicas of one process."""

    def __init__(self, num_packs: int = 1):
        if not isinstance(num_packs, int) or num_packs < 1:
            raise InvalidArgumentError(f"num_packs must be a positive int, got {num_packs!r}.")
        self.num_packs = num_packs

    def validate(self, devices: Sequence[LogicalDevice]) -> None:
        """Raise if these ops cannot serve ``devices``."""

    # -- single tensors -------------------------------------------------------------
    def reduce(
        self, reduce_op: ReduceOp | str, values: Sequence[torch.Tensor], destination: torch.device
    ) -> torch.Tensor:
        """Combine one tensor per replica into one tensor on ``destination``."""
        return self.batch_reduce(reduce_op, [[v] for v in values], destination)[0]

    def all_reduce(self, reduce_op: ReduceOp | str, values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Combine one tensor per replica; every replica gets the result on its own device."""
        return [r[0] for r in self.batch_all_reduce(reduce_op, [[v] for v in values])]

    def broadcast(self, tensor: torch.Tensor, devices: Sequence[torch.device]) -> list[torch.Tensor]:
        """A copy of ``tensor`` on each device (the first is ``tensor`` itself when it fits)."""
        out = []
        for i, device in enumerate(devices):
            if i == 0 and tensor.device == device:
                out.append(tensor)
            else:
                out.append(tensor.to(device, copy=True, non_blocking=True))
        return out

    # -- lists of tensors (one list per replica) ---------------------------------------
    def batch_reduce(
        self,
        reduce_op: ReduceOp | str,
        per_replica_tensors: Sequence[Sequence[torch.Tensor]],
        destination: torch.device,
    ) -> list[torch.Tensor]:
        op = ReduceOp.from_value(reduce_op)
        _check_same_shapes(per_replica_tensors)
        results: list[torch.Tensor] = [None] * len(per_replica_tensors[0])  # type: ignore[list-item]
        for indices in packs_by_dtype(per_replica_tensors[0], self.num_packs):
            flats = [pack([tensors[i] for i in indices]) for tensors in per_replica_tensors]
            total = self._reduce_flat(flats, destination)
            if op is ReduceOp.MEAN:
                total = divide(total, len(flats))
            for i, piece in zip(indices, unpack(total, [per_replica_tensors[0][i] for i in indices]), strict=True):
                results[i] = piece
        return results

    def batch_all_reduce(
        self, reduce_op: ReduceOp | str, per_replica_tensors: Sequence[Sequence[torch.Tensor]]
    ) -> list[list[torch.Tensor]]:
        op = ReduceOp.from_value(reduce_op)
        _check_same_shapes(per_replica_tensors)
        devices = [tensors[0].device if tensors else torch.device("cpu") for tensors in per_replica_tensors]
        num_replicas = len(per_replica_tensors)
        out: list[list[torch.Tensor]] = [[None] * len(per_replica_tensors[0]) for _ in range(num_replicas)]  # type: ignore[list-item]
        for indices in packs_by_dtype(per_replica_tensors[0], self.num_packs):
            flats = [pack([tensors[i] for i in indices]) for tensors in per_replica_tensors]
            reduced = self._all_reduce_flat(flats)
            for r in range(num_replicas):
                flat = reduced[r].to(devices[r], non_blocking=True)
                if op is ReduceOp.MEAN:
                    flat = divide(flat, num_replicas)
                templates = [per_replica_tensors[r][i] for i in indices]
                for i, piece in zip(indices, unpack(flat, templates), strict=True):
                    out[r][i] = piece
        return out

    # -- what subclasses implement -------------------------------------------------------
    def _reduce_flat(self, flats: list[torch.Tensor], destination: torch.device) -> torch.Tensor:
        total = flats[0].to(destination, copy=True)
        for flat in flats[1:]:
            total.add_(flat.to(destination, non_blocking=True))
        return total

    def _all_reduce_flat(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        total = self._reduce_flat(flats, flats[0].device)
        # Each replica gets its own buffer: replicas may modify their result in place.
        return [total] + [total.to(f.device, copy=True, non_blocking=True) for f in flats[1:]]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_packs={self.num_packs})"


class ReductionToOneDevice(CrossDeviceOps):
    """Copy every replica's value to one device, sum there, copy the result back.

    Works for any devices; the default for CPU replicas.
    """

    def __init__(self, reduce_to_device: str | None = None, num_packs: int = 1):
        super().__init__(num_packs)
        self.reduce_to_device = canonicalize(reduce_to_device) if reduce_to_device else None

    def _all_reduce_flat(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        target = self.reduce_to_device.torch_device if self.reduce_to_device else flats[0].device
        total = self._reduce_flat(flats, target)
        return [total.to(f.device, copy=True, non_blocking=True) if (i or f.device != target) else total
                for i, f in enumerate(flats)]


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """Sum pairwise down a binary tree of devices, then broadcast back up.

    Each level halves the number of partial sums, so no single device receives N copies at
    once; a good choice for GPUs without NCCL.
    """

    def _all_reduce_flat(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        partial = [f.clone() for f in flats]
        step = 1
        while step < len(partial):
            for i in range(0, len(partial) - step, 2 * step):
                partial[i].add_(partial[i + step].to(partial[i].device, non_blocking=True))
            step *= 2
        total = partial[0]
        return [total] + [total.to(f.device, copy=True, non_blocking=True) for f in flats[1:]]

    def _reduce_flat(self, flats: list[torch.Tensor], destination: torch.device) -> torch.Tensor:
        return self._all_reduce_flat(flats)[0].to(destination)


class NcclAllReduce(CrossDeviceOps):
    """All-reduce with NCCL between the GPUs of this process (CUDA devices only)."""

    def validate(self, devices: Sequence[LogicalDevice]) -> None:
        not_cuda = [d.name for d in devices if not d.is_cuda]
        if not_cuda:
            raise InvalidDeviceError(
                f"NcclAllReduce only works between CUDA devices, but the strategy has "
                f"{', '.join(not_cuda)}. Use td.ReductionToOneDevice() (or leave "
                "cross_device_ops=None to pick the best one) for CPU replicas."
            )
        if share_a_gpu(devices):
            raise InvalidDeviceError(
                f"NcclAllReduce cannot reduce between logical GPUs of one physical GPU (NCCL refuses "
                f"two ranks on one device), and {', '.join(d.name for d in devices)} share one. Use "
                "td.ReductionToOneDevice() or td.HierarchicalCopyAllReduce() (or leave "
                "cross_device_ops=None to pick one)."
            )
        if not _nccl_available():
            raise InvalidDeviceError(
                "NcclAllReduce needs PyTorch built with NCCL; use td.HierarchicalCopyAllReduce()."
            )

    def _all_reduce_flat(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        import torch.cuda.nccl as nccl

        outputs = [f.clone() for f in flats]
        nccl.all_reduce(outputs)
        return outputs


def _nccl_available() -> bool:
    try:
        import torch.cuda.nccl as nccl

        return torch.cuda.is_available() and nccl.is_available([torch.zeros(1, device="cuda")])
    except Exception:  # noqa: BLE001 - any failure means "not usable"
        return False


def select_cross_device_ops(devices: Sequence[LogicalDevice]) -> CrossDeviceOps:
    """The best ops for ``devices``: NCCL between several distinct GPUs, else reduce-to-one."""
    if len(devices) > 1 and all(d.is_cuda for d in devices) and not share_a_gpu(devices):
        if _nccl_available():
            return NcclAllReduce()
        return HierarchicalCopyAllReduce()
    return ReductionToOneDevice()


def _check_same_shapes(per_replica_tensors: Sequence[Sequence[torch.Tensor]]) -> None:
    """Every replica gives as many tensors, each of the same shape and dtype as replica 0's
    (compared before anything is packed or moved: no data is read)."""
    if not per_replica_tensors:
        raise InvalidArgumentError("Nothing to reduce: no replica gave any tensors.")
    first = per_replica_tensors[0]
    for r, tensors in enumerate(per_replica_tensors[1:], start=1):
        if len(tensors) != len(first):
            raise InvalidArgumentError(
                f"Replica {r} gave {len(tensors)} tensors to reduce but replica 0 gave {len(first)}."
            )
        for i, (a, b) in enumerate(zip(first, tensors, strict=True)):
            try:
                alike = a.shape == b.shape and a.dtype == b.dtype
            except AttributeError:  # not a tensor
                alike = False
            if not alike:
                _explain_mismatch(i, [replica[i] for replica in per_replica_tensors])


def _explain_mismatch(index: int, column: list[Any]) -> None:
    """Raise the error for tensor ``index``, whose replicas' values do not match."""
    for r, tensor in enumerate(column):
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(
                f"Cannot reduce value {index}: replica {r} gave a {type(tensor).__name__} "
                f"({tensor!r:.60}), not a tensor."
            )
    check_same_layout(column, f"Cannot reduce tensor {index}")
