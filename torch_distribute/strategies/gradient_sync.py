"""Gradient summation across workers, in buckets launched while backward is still running.

As DDP's reducer does: the optimizer's parameters are packed, in reverse order (the order
backward produces their gradients), into buckets of ``bucket_bytes``. A hook fires when a
parameter's gradient is complete on every local replica; when a whole bucket is complete
(and every bucket before it was launched), its local sum is written into a flat buffer and an
asynchronous SUM all-reduce over the workers starts, while backward continues. The optimizer
step waits for the buckets and copies the sums into copy 0's gradients.

Every bucket carries one extra element per parameter, 1 where the worker had a gradient:
after the SUM it says whether *any* worker had one, so a parameter no worker used keeps
``grad=None`` (as on one device) instead of getting zeros that would move Adam's moments.
If backward runs again before the step (gradient accumulation), the launched sums are stale:
the step waits for them and reduces everything again from the accumulated gradients.

Every bucket also ends with a signature (``fingerprint.signature``): ±1 signs from the number
of the optimizer step it belongs to and of the ``strategy.run`` call. After the SUM the step
checks that every worker wrote the same signs, so a worker that skipped or repeated
``optimizer.step()`` raises ``ReplicaMismatchError`` on every worker instead of summing
gradients of different steps.

After the step each ``.grad`` is a view of its bucket (as DDP's ``gradient_as_bucket_view``):
the sum is not copied back. A gradient still aliasing its bucket at the next launch gets its
own memory first, so a backward can never write into a bucket that is being all-reduced.
"""

from __future__ import annotations

import threading
from typing import Any, NoReturn, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from torch_distribute.collectives import fingerprint
from torch_distribute.collectives.packing import unpack
from torch_distribute.eager import never_compiled
from torch_distribute.strategies.replicated_state import MirroredTensor, ReplicatedState


class GradientGroup(Protocol):
    """What the buckets need of a group of workers: ``WorkerGroup``, or a fault-tolerant job's
    ``FaultTolerantGroup`` (whose failed collectives return at once and say so in
    ``collectives_failed``)."""

    @property
    def world_size(self) -> int: ...

    @property
    def collectives_failed(self) -> bool: ...

    def step_label(self, optimizer_steps: int) -> tuple[int, int]: ...

    def start_agreement(self, kind: str, what: str) -> Any: ...

    def finish_agreement(self, agreement: Any) -> Any: ...

    def all_reduce_async(self, tensor: torch.Tensor) -> Any: ...

    def wait(self, what: str, work: Any) -> None: ...

    def raise_mismatch(self, description: str) -> NoReturn: ...


class _Bucket:
    """One flat buffer: every record's gradient (a view each), one flag per record, then the
    signature."""

    def __init__(self, records: list[MirroredTensor], device: torch.device, dtype: torch.dtype):
        self.records = records
        total = sum(r.live_primary().numel() for r in records)
        self.flat = torch.zeros(total + len(records) + fingerprint.SIGNATURE_LENGTH, device=device, dtype=dtype)
        self.views = [v.view(-1) for v in unpack(self.flat, [r.live_primary() for r in records])]
        self.flag_offset = total
        self.signature_offset = total + len(records)


class GradientSynchronizer:
    """Sums one optimizer's gradients over local replicas and workers."""

    def __init__(self, state: ReplicatedState, records: list[MirroredTensor], group: GradientGroup,
                 num_local: int, bucket_bytes: int):
        self._state = state
        self._hooked_generation = -1
        self._group = group
        self._num_local = num_local
        self._lock = threading.Lock()
        trainable = [r for r in records if r.primary.requires_grad]
        self._buckets = _make_buckets(list(reversed(trainable)), bucket_bytes)
        self._hooked: dict[int, tuple[int, ...]] = {}
        self._handles: list[RemovableHandle] = []
        self._steps = 0  # optimizer steps finished
        self._reset_round()

    def _reset_round(self) -> None:
        self._ready: list[list[set[int]]] = [[set() for _ in b.records] for b in self._buckets]
        self._pending = [len(b.records) for b in self._buckets]
        self._next = 0
        self._works: list[Any] = []
        self._dirty = False
        self._agreement: Any = None

    def _start_agreement(self) -> None:
        """Start comparing this step with the other workers' (overlapping the backward).

        On the main group: a worker making another collective instead (a reduce, a save),
        or another step, is named at once, before any bucket of another step is summed.
        """
        step, run = self._group.step_label(self._steps + 1)
        self._agreement = self._group.start_agreement(
            "optimizer step", f"optimizer step {step} in strategy.run #{run} (gradient all-reduce)")

    # -- hooks -----------------------------------------------------------------------------
    def attach_hooks(self) -> None:
        """(Re-)register hooks on the current copies of every parameter (cheap when done)."""
        if self._hooked_generation == self._state.copies_generation:
            return
        self._hooked_generation = self._state.copies_generation
        for b, bucket in enumerate(self._buckets):
            for slot, record in enumerate(bucket.records):
                copies = tuple(id(c) for c in record.copies or ())
                if not copies or self._hooked.get(id(record)) == copies:
                    continue
                self._hooked[id(record)] = copies
                for k, replica_copy in enumerate(record.current_copies()):
                    self._handles.append(replica_copy.register_post_accumulate_grad_hook(
                        never_compiled(lambda _t, b=b, slot=slot, k=k: self._on_grad(b, slot, k))))

    def _on_grad(self, b: int, slot: int, k: int) -> None:
        # Registered never_compiled: under a compiled step dynamo would otherwise
        # compile this hook (the bucket launch, the fingerprint exchange) into graphs of its own.
        with self._lock:
            ready = self._ready[b][slot]
            if k in ready:
                self._dirty = True  # a second backward before the step
                return
            ready.add(k)
            if len(ready) == self._num_local:
                self._pending[b] -= 1
                self._launch_in_order()

    def _launch_in_order(self) -> None:
        if self._next == 0 and self._agreement is None and self._pending[0] == 0:
            self._start_agreement()
        while self._next < len(self._buckets) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        bucket = self._buckets[b]
        flags = []
        with torch.no_grad():
            for slot, record in enumerate(bucket.records):
                view = bucket.views[slot]
                copies = record.current_copies()
                grads = [c.grad for c in copies if c.grad is not None]
                if grads and _aliases(grads[0], view):
                    # Still the view of the last sum (zero_grad(set_to_none=False) or no
                    # zero_grad): give it its own memory, so a backward that runs while this
                    # bucket is in flight cannot write into it.
                    copies[0].grad = grads[0] = grads[0].clone()
                if grads:
                    view.copy_(grads[0].reshape(-1))
                    for grad in grads[1:]:
                        view.add_(grad.reshape(-1).to(view.device, non_blocking=True))
                else:
                    view.zero_()
                flags.append(1.0 if grads else 0.0)
            signs = fingerprint.signature(*self._group.step_label(self._steps + 1))
            bucket.flat[bucket.flag_offset:].copy_(torch.tensor([*flags, *signs], dtype=bucket.flat.dtype))
        self._works.append(self._group.all_reduce_async(bucket.flat))

    # -- the optimizer step ------------------------------------------------------------------
    def finish(self) -> None:
        """Wait for every bucket and leave the global sums in copy 0's gradients."""
        with self._lock:
            if self._agreement is not None and self._dirty:
                # Started by a backward before the last one (gradient accumulation, or a
                # skipped step): settle it, then compare this step afresh.
                self._group.finish_agreement(self._agreement)
                self._agreement = None
            if self._agreement is None:
                self._start_agreement()
            agreement = self._agreement
        if agreement is not None:
            self._group.finish_agreement(agreement)
        with self._lock:
            if self._dirty:
                for work in self._works:
                    self._group.wait("gradient all-reduce", work)
                self._works, self._next = [], 0
            while self._next < len(self._buckets):
                self._launch(self._next)
                self._next += 1
            works = self._works
        for work in works:
            self._group.wait("gradient all-reduce", work)
        # Each bucket's flags and signature, read in one transfer.
        tails = [bucket.flat[bucket.flag_offset:].tolist() for bucket in self._buckets]
        self._check_signatures(tails)
        with torch.no_grad():
            for bucket, tail in zip(self._buckets, tails, strict=True):
                flags = tail[:len(bucket.records)]
                for slot, record in enumerate(bucket.records):
                    primary = record.live_primary()
                    # The sum becomes the gradient in place: a view of the bucket, no copy.
                    primary.grad = bucket.views[slot].view_as(primary) if flags[slot] else None
                    for replica_copy in record.current_copies():
                        if replica_copy is not primary:
                            replica_copy.grad = None
        with self._lock:
            self._steps += 1
            self._reset_round()

    def finish_alone(self) -> None:
        """The only worker of the step (a fault-tolerant job down to one): the gradients are
        their own sums already. Wait for what backward launched, and leave every ``.grad`` as
        it is: a ``GradScaler`` or a clipping may have changed it in place since backward."""
        with self._lock:
            agreement, works = self._agreement, self._works
        if agreement is not None:
            self._group.finish_agreement(agreement)
        for work in works:
            self._group.wait("gradient all-reduce", work)
        with self._lock:
            self._steps += 1
            self._reset_round()

    def _check_signatures(self, tails: list[list[float]]) -> None:
        """Every worker summed gradients of the same optimizer step and run, or all raise.
        ``tails``: each bucket's summed flags and signature. (Not when a fault-tolerant
        group lost a member: the sums are this worker's own and the step is dropped.)"""
        if self._group.collectives_failed:
            return
        step, run = self._group.step_label(self._steps + 1)
        signs = fingerprint.signature(step, run)
        expected = [sign * self._group.world_size for sign in signs]
        for bucket, tail in zip(self._buckets, tails, strict=True):
            if tail[len(bucket.records):] != expected:
                with self._lock:
                    self._reset_round()
                self._group.raise_mismatch(
                    f"gradient all-reduce of optimizer step {step} in strategy.run "
                    f"#{run} (a worker skipped or repeated optimizer.step()?)")

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _aliases(tensor: torch.Tensor, view: torch.Tensor) -> bool:
    return tensor.data_ptr() == view.data_ptr() and tensor.numel() == view.numel()


def _make_buckets(records: list[MirroredTensor], bucket_bytes: int) -> list[_Bucket]:
    buckets: list[_Bucket] = []
    current: list[MirroredTensor] = []
    size = 0
    for record in records:
        primary = record.primary
        if current and (
            primary.dtype != current[0].primary.dtype
            or primary.device != current[0].primary.device
            or size + primary.numel() * primary.element_size() > bucket_bytes
        ):
            buckets.append(_Bucket(current, current[0].primary.device, current[0].primary.dtype))
            current, size = [], 0
        current.append(record)
        size += primary.numel() * primary.element_size()
    if current:
        buckets.append(_Bucket(current, current[0].primary.device, current[0].primary.dtype))
    return buckets
