"""``MirroredStrategy``: synchronous training on several devices of one process.

Every parameter and buffer made in ``scope()`` gets a copy per replica device; ``run`` calls
the step function on every replica concurrently, each with its own slice of the batch;
``optimizer.step()`` inside ``run`` sums the gradients of all replicas, updates copy 0 with the
user's own optimizer, and copies the new values to the other replicas, so after every step
all copies are bitwise equal.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from torch_distribute import context
from torch_distribute.collectives import CrossDeviceOps
from torch_distribute.devices import DeviceLike, LogicalDevice, canonicalize_all, local_devices
from torch_distribute.errors import InvalidArgumentError, UnmirroredStateError
from torch_distribute.reduce_op import ReduceOp
from torch_distribute.replica_context import ReplicaContext
from torch_distribute.strategies.base import Strategy
from torch_distribute.strategies.extended import StrategyExtended
from torch_distribute.strategies.global_gradients import GlobalGradients, GradientState
from torch_distribute.strategies.nonfinite import NonFiniteMonitor
from torch_distribute.strategies.replica_threads import ReplicaThreads, outside_replica_mode
from torch_distribute.strategies.replicated import ReplicatedExtended
from torch_distribute.strategies.replicated_state import MirroredTensor, ReplicaTensorMode
from torch_distribute.strategies.single_replica import SingleReplicaExtended


class MirroredReplicaContext(ReplicaContext):
    """Replica context whose ``merge_call`` meets the other replica threads."""

    def __init__(self, strategy: context.StrategyLike, replica_id: int, threads: ReplicaThreads):
        super().__init__(strategy, replica_id)
        self._threads = threads

    def merge_call_now(self, merge_fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return self._threads.merge_call(self.local_replica_id, merge_fn, args, kwargs)


class MirroredExtended(ReplicatedExtended):
    """The mirrored family's ``run`` and optimizer step: replicas compute concurrently, the
    step sums their gradients into the user's tensors, steps once and broadcasts.

    Variants extend it through these protected hooks (listed in docs/architecture.md), never
    by re-doing the bookkeeping around them:

    - ``_run_replicas(fn, args, kwargs)``: run the step function on every local replica.
    - ``_reduce_gradients(optimizer, records)``: leave the gradient summed over every replica
      (and worker) in each record's user tensor's ``.grad``; the replicas drop their parts.
    - ``_after_optimizer_step(records)``: after the user's step, before the new values are
      broadcast to the replicas.
    - ``_gather_nonfinite(local)``: every worker's list of replicas whose loss is not finite.
    - ``_new_state(devices, cross_device_ops)`` (from ``ReplicatedExtended``): the layout of
      the per-replica copies.

    >>> import torch, torch_distribute as td
    >>> strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> type(strategy.extended).__name__, strategy.extended.intercepts_optimizer_steps
    ('MirroredExtended', True)
    """

    def __init__(
        self,
        strategy: Strategy,
        devices: tuple[LogicalDevice, ...],
        cross_device_ops: CrossDeviceOps | None,
    ):
        super().__init__(strategy, devices, cross_device_ops)
        self._threads: ReplicaThreads | None = None
        self._global_gradients = GlobalGradients()
        self._nonfinite = NonFiniteMonitor(strategy)
        self._steps_taken: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        self._next_run_takes_turns = False  # set by compiling_replica_steps for one run

    def _replica_threads(self) -> ReplicaThreads:
        if self._threads is None:
            devices = list(self.replica_devices)
            cpu_replicas = sum(1 for d in devices if d.type == "cpu")
            intra_op = max(1, torch.get_num_threads() // cpu_replicas) if cpu_replicas > 1 else None
            self._threads = ReplicaThreads(devices, intra_op)
            # The threads hold no reference to the strategy; stop them when it goes away.
            weakref.finalize(self._strategy, self._threads.close)
        return self._threads

    def compiling_replica_steps(self, take_turns: bool) -> None:
        super().compiling_replica_steps(take_turns)
        # Replicas on different devices share no graph: nothing to wait for.
        self._next_run_takes_turns = take_turns and self._replicas_share_a_device()

    def call_for_each_replica(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self._global_gradients.forget_all()  # a new backward: gradients are local again
        self._state.sync_stale()
        result = self._run_replicas(fn, args, kwargs)
        self._state.aggregate_buffers()
        return result

    def _run_replicas(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Hook: run ``fn`` on every local replica, each in its thread with its copies."""
        threads = self._replica_threads()
        replica_contexts = [
            MirroredReplicaContext(self._strategy, self.replica_id_offset + k, threads)
            for k in range(self.num_local_replicas)
        ]
        modes: list[TorchFunctionMode] = [
            ReplicaTensorMode(self._state, k, strict=True) for k in range(self.num_local_replicas)
        ]
        take_turns, self._next_run_takes_turns = self._next_run_takes_turns, False
        return threads.run(fn, args, kwargs, self._strategy, replica_contexts, modes, take_turns=take_turns)

    # -- optimizers ------------------------------------------------------------------------
    @property
    def intercepts_optimizer_steps(self) -> bool:
        # Alone and computing with the user's tensors, the user's own step is already right.
        return self.num_replicas_in_sync > 1 or bool(self._state.replicas_on_copies)

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, step: Callable[..., Any], closure: Callable[[], Any] | None
    ) -> Any:
        if closure is not None:
            raise InvalidArgumentError(
                "optimizer.step(closure) is not supported with several replicas: the closure "
                "would re-evaluate the loss on one replica only. Use an optimizer without "
                "a closure (not LBFGS) under MirroredStrategy."
            )
        replica = context.get_replica_context()
        if replica is not None and replica.strategy is self._strategy:
            return replica.merge_call(lambda _s: self._apply_optimizer(optimizer, step))
        return self._apply_optimizer(optimizer, step)

    def apply_to_global_gradients(self, optimizer: torch.optim.Optimizer, fn: Callable[[], Any]) -> Any:
        records = self._optimizer_records(optimizer)
        if self._global_gradients.is_local(optimizer):
            self._reduce_gradients(optimizer, records)
            self._global_gradients.mark_summed(optimizer)
        result = fn()
        if not self._global_gradients.is_local(optimizer):  # fn did not step
            self._share_gradients(records)
            self._global_gradients.mark_shared(optimizer)
        return result

    def _share_gradients(self, records: list[MirroredTensor]) -> None:
        """Every replica gets the global gradient: copies, never aliases, since each replica
        modifies its own in place."""
        with torch.no_grad():
            for record in records:
                primary = record.live_primary()
                grad = primary.grad
                for replica_copy in record.copies or ():
                    if replica_copy is not primary:
                        replica_copy.grad = None if grad is None else grad.to(replica_copy.device, copy=True)

    def _take_shared_gradients(self, records: list[MirroredTensor]) -> None:
        """Replica 0's gradient, as the step function left it, is the one to apply; the
        other replicas' copies of it are dropped."""
        with torch.no_grad():
            for record in records:
                primary, copies = record.live_primary(), record.copies or []
                if copies and copies[0] is not primary:  # replica 0 computed with a copy
                    grad = copies[0].grad
                    primary.grad = None if grad is None else grad.to(primary.device)
                for replica_copy in copies:
                    if replica_copy is not primary:
                        replica_copy.grad = None

    def optimizer_zero_grad(
        self, optimizer: torch.optim.Optimizer, zero_grad: Callable[..., Any], set_to_none: bool
    ) -> None:
        self._global_gradients.forget(optimizer)
        replica = context.get_replica_context()
        if replica is not None and replica.strategy is self._strategy:
            self._zero_replica_grads(optimizer, replica.local_replica_id, set_to_none)
        else:
            zero_grad(set_to_none)
            for k in self._state.replicas_on_copies:
                self._zero_replica_grads(optimizer, k, set_to_none)

    def _optimizer_records(self, optimizer: torch.optim.Optimizer) -> list[MirroredTensor]:
        records = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                record = self._state.lookup(param)
                if record is None:
                    raise UnmirroredStateError(
                        f"{type(optimizer).__name__} holds a parameter of shape "
                        f"{tuple(param.shape)} that was not created inside strategy.scope(); "
                        "create the module inside the scope too."
                    )
                records.append(record)
        return records

    def _apply_optimizer(self, optimizer: torch.optim.Optimizer, step: Callable[..., Any]) -> Any:
        """Sum the replicas' gradients into the user's tensors, step, broadcast the new values."""
        records = self._optimizer_records(optimizer)
        found = self._global_gradients.take(optimizer)
        if found is GradientState.LOCAL:
            self._reduce_gradients(optimizer, records)
        elif found is GradientState.SHARED:  # summed already (GradScaler.unscale_), then handed out
            self._take_shared_gradients(records)
        # SUMMED: the step runs inside apply_to_global_gradients (GradScaler.step), on the sum.
        number = self._steps_taken.get(optimizer, 0) + 1
        self._steps_taken[optimizer] = number
        self._nonfinite.check([r.live_primary().grad for r in records],
                              f"optimizer step {number} ({type(optimizer).__name__})", self._gather_nonfinite)
        if not self._commit_step(records):
            return None
        result = step()
        self._after_optimizer_step(records)
        if self._state.replicas_on_copies:
            self._state.broadcast([r for r in records if r.is_stale()])
        return result

    def _reduce_gradients(self, optimizer: torch.optim.Optimizer, records: list[MirroredTensor]) -> None:
        """Hook: leave the sum over every replica in each user tensor's ``.grad`` (here the
        local replicas: one worker); the replicas drop their parts."""
        with_grad = [r for r in records if any(c.grad is not None for c in r.copies or ())]
        if not with_grad:
            return
        if set(self.replica_devices) == {self.primary_device}:
            self._sum_in_place(with_grad)
            return
        per_replica = [
            [_grad_or_zeros(r.current_copies()[k]) for r in with_grad] for k in range(self.num_local_replicas)
        ]
        summed = self._cross_device_ops.batch_reduce(ReduceOp.SUM, per_replica, self.primary_device)
        for record, grad in zip(with_grad, summed, strict=True):
            primary, copies = record.live_primary(), record.current_copies()
            if primary.grad is None:
                primary.grad = grad.clone()
            elif copies[0] is primary:  # the sum already holds replica 0's own gradient
                primary.grad.copy_(grad)
            else:  # replica 0 computed with a copy: add to what earlier steps accumulated
                primary.grad.add_(grad)
            # The replicas drop their part: it is in the primary's gradient now, so gradients
            # accumulated over several steps without zero_grad are still summed once.
            for replica_copy in copies:
                if replica_copy is not primary:
                    replica_copy.grad = None

    def _sum_in_place(self, records: list[MirroredTensor]) -> None:
        """Replicas on one device (CPU replicas): add every replica's gradient into the user
        tensor's.

        Same order of additions as the packed reduction (replica 0, 1, 2, ...), without
        packing and unpacking: one fused ``_foreach_add_`` per replica.
        """
        with torch.no_grad():
            targets: list[torch.Tensor] = []
            for record in records:
                primary = record.live_primary()
                if primary.grad is None:
                    primary.grad = torch.zeros_like(primary)
                targets.append(primary.grad)
            for k in self._state.replicas_on_copies:
                pairs = [(t, g) for t, r in zip(targets, records, strict=True)
                         if (g := r.current_copies()[k].grad) is not None]
                if pairs:
                    torch._foreach_add_([t for t, _ in pairs], [g for _, g in pairs])
                for record in records:
                    record.current_copies()[k].grad = None

    def _commit_step(self, records: list[MirroredTensor]) -> bool:
        """Hook: whether to apply the optimizer step to the summed gradients (always, here).
        A fault-tolerant variant asks torchft, and when the step is dropped it leaves the
        gradients and state as they were before the step; the user's step is then skipped
        and ``optimizer.step()`` returns None."""
        return True

    def _after_optimizer_step(self, records: list[MirroredTensor]) -> None:
        """Hook: after the user's step, before the new values go to the replicas (nothing
        here; a multi-worker variant drops the summed gradient on all but one worker)."""

    def _gather_nonfinite(self, local: list[tuple[int, float]]) -> list[list[tuple[int, float]]]:
        """Hook: every worker's replicas with a non-finite loss (one worker here)."""
        return [local]

    def _zero_replica_grads(self, optimizer: torch.optim.Optimizer, local_id: int, set_to_none: bool) -> None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                record = self._state.lookup(param)
                # Replica 0 clears the user's tensor (also where replica 0 computes with a
                # copy of it, which is a different tensor).
                if local_id == 0:
                    with outside_replica_mode():  # the user's tensor itself, not replica 0's copy
                        _zero_grad_of(param, set_to_none)
                if record is not None and record.copies is not None:
                    replica_copy = record.copies[local_id]
                    if replica_copy is not param:
                        _zero_grad_of(replica_copy, set_to_none)


def _grad_or_zeros(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)


def _zero_grad_of(tensor: torch.Tensor, set_to_none: bool) -> None:
    if tensor.grad is None:
        return
    if set_to_none:
        tensor.grad = None
    else:  # as torch.optim.Optimizer.zero_grad does
        if tensor.grad.grad_fn is not None:
            tensor.grad.detach_()
        else:
            tensor.grad.requires_grad_(False)
        tensor.grad.zero_()


class MirroredStrategy(Strategy):
    """Synchronous data parallelism over the devices of one process.

    ``devices=None`` uses every visible GPU, else every logical CPU device (one unless
    ``td.config.set_logical_device_configuration`` split the CPU, as TensorFlow's guides do).
    CPU replicas (``["cpu:0", "cpu:1"]``) are real replicas computing concurrently on the host,
    which is how the same program is tested without GPUs.

    >>> import torch, torch_distribute as td
    >>> strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> strategy.num_replicas_in_sync
    2
    >>> per_replica = strategy.run(lambda: td.get_replica_context().replica_id_in_sync_group)
    >>> strategy.experimental_local_results(per_replica)
    (0, 1)
    """

    def __init__(self, devices: Sequence[DeviceLike] | None = None, cross_device_ops: CrossDeviceOps | None = None):
        parsed = canonicalize_all(devices) if devices is not None else local_devices(logical_cpus=True)
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise InvalidArgumentError(
                f"cross_device_ops must be a td.CrossDeviceOps (e.g. td.ReductionToOneDevice()), "
                f"got {type(cross_device_ops).__name__}."
            )
        if len(parsed) == 1:
            extended: StrategyExtended = SingleReplicaExtended(self, parsed[0], place_state=True)
        else:
            extended = MirroredExtended(self, parsed, cross_device_ops)
        super().__init__(extended)
