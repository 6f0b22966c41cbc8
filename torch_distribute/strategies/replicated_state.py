"""Per-replica copies of the parameters and buffers created in a strategy's scope.

Copy 0 of every tensor is the tensor the user holds (``model.weight``); copies 1..N-1 live
on the other replicas' devices. Once compiled steps run on replicas that share a device,
replica 0 computes with a copy too (``put_every_replica_on_copies``), so that every replica
traces the same graph and inductor compiles it once. Inside ``run``, ``ReplicaTensorMode`` swaps the user's tensor
for the current replica's copy in every torch call, so ``model(x)`` computes with that
replica's weights while the Python objects stay the same.

Copies are refreshed lazily: any change to copy 0 outside ``run`` (random init,
``load_state_dict``, ``copy_``) bumps its version counter, and the next ``run`` re-broadcasts
it. After an optimizer step the strategy broadcasts the new values itself.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.overrides import TorchFunctionMode

from torch_distribute.collectives import CrossDeviceOps
from torch_distribute.errors import UnmirroredStateError
from torch_distribute.reduce_op import ReduceOp

# Set on the user's buffers made in a scope (parameters are recognised by their type).
MIRRORED_BUFFER = "_torch_distribute_mirrored"


class MirroredTensor:
    """Bookkeeping for one parameter or buffer: its per-replica copies and sync stamps."""

    __slots__ = ("_primary", "copies", "is_buffer", "_stamp", "_copy_versions", "_norm_layer", "__weakref__")

    def __init__(self, primary: torch.Tensor, is_buffer: bool, norm_layer: nn.Module | None = None):
        self._primary = weakref.ref(primary)
        self.copies: list[torch.Tensor] | None = None
        self.is_buffer = is_buffer
        # Running statistics of a norm layer: updated in place by the batch_norm kernel,
        # which does not bump the version counter, so "changed" is "the layer is training".
        self._norm_layer = weakref.ref(norm_layer) if norm_layer is not None else None
        self._stamp: tuple[int, int, tuple[int, ...]] | None = None
        self._copy_versions: tuple[int, ...] = ()

    @property
    def primary(self) -> torch.Tensor | None:
        return self._primary()

    def live_primary(self) -> torch.Tensor:
        """The user's tensor, where the caller holds it (an optimizer, the state's records)."""
        primary = self._primary()
        assert primary is not None, "a record read after its tensor was collected"
        return primary

    def current_copies(self) -> list[torch.Tensor]:
        """One tensor per replica, where the record was broadcast at least once."""
        assert self.copies is not None, "a record read before its first broadcast"
        return self.copies

    def stamp(self) -> tuple[int, int, tuple[int, ...]]:
        p = self._primary()
        return (p._version, p.data_ptr(), tuple(p.shape))

    def mark_synced(self) -> None:
        self._stamp = self.stamp()
        self._copy_versions = tuple(c._version for c in self.copies or ())

    def is_stale(self) -> bool:
        return self.copies is None or self._stamp != self.stamp()

    def copies_changed(self) -> bool:
        if self._norm_layer is not None:
            layer = self._norm_layer()
            if layer is not None and layer.training:
                return True
        return tuple(c._version for c in self.copies or ()) != self._copy_versions


class ReplicatedState:
    """All mirrored tensors of one strategy, keyed by the identity of the user's tensor.

    Replica 0 computes with the user's tensor itself (``copies[0]`` is it), on
    ``primary_device``, the first replica device; the other replicas compute with copies,
    and after ``put_every_replica_on_copies()`` replica 0 as well. A layout where every
    replica always computes with a copy (central storage) overrides ``replicas_on_copies``
    and ``primary_device``.

    >>> import torch
    >>> from torch_distribute.collectives import ReductionToOneDevice
    >>> state = ReplicatedState([torch.device("cpu")] * 2, ReductionToOneDevice())
    >>> weight = torch.nn.Parameter(torch.ones(2))
    >>> state.register(weight, is_buffer=False); state.sync_stale()
    >>> state.local_copies(weight)[0] is weight, list(state.replicas_on_copies)
    (True, [1])
    """

    def __init__(self, devices: Sequence[torch.device], cross_device_ops: CrossDeviceOps):
        self.devices = list(devices)
        self.cross_device_ops = cross_device_ops
        self._records: dict[int, MirroredTensor] = {}
        self._fresh: list[MirroredTensor] = []
        self._buffers: list[MirroredTensor] = []
        self.copies_generation = 0  # bumped whenever a record gets new copy tensors
        # Set by multi-worker strategies: make tensors equal across worker processes.
        self.worker_broadcast: Callable[[list[torch.Tensor]], None] | None = None
        self.worker_mean: Callable[[list[torch.Tensor]], None] | None = None
        self._replica_zero_on_copy = False
        self._relayout = False  # replica 0's copies are still to be made

    @property
    def num_replicas(self) -> int:
        return len(self.devices)

    @property
    def primary_device(self) -> torch.device:
        """Where the user's tensors live: replica 0's device."""
        return self.devices[0]

    @property
    def replicas_on_copies(self) -> range:
        """The local replicas that compute with a copy of the user's tensors, not the tensors
        themselves: every replica but replica 0 (every one, after ``put_every_replica_on_copies``)."""
        return range(0 if self._replica_zero_on_copy else 1, self.num_replicas)

    def put_every_replica_on_copies(self) -> None:
        """From the next ``sync_stale`` on, replica 0 computes with copies too (one more
        copy of every tensor on replica 0's device), as the other replicas do.

        >>> import torch
        >>> from torch_distribute.collectives import ReductionToOneDevice
        >>> state = ReplicatedState([torch.device("cpu")] * 2, ReductionToOneDevice())
        >>> weight = torch.nn.Parameter(torch.ones(2))
        >>> state.register(weight, is_buffer=False); state.sync_stale()
        >>> state.put_every_replica_on_copies(); state.sync_stale()
        >>> state.local_copies(weight)[0] is weight, list(state.replicas_on_copies)
        (False, [0, 1])
        """
        if not self._replica_zero_on_copy:
            self._replica_zero_on_copy = self._relayout = True

    def register(self, tensor: torch.Tensor, is_buffer: bool, norm_layer: nn.Module | None = None) -> None:
        key = id(tensor)
        if is_buffer:
            setattr(tensor, MIRRORED_BUFFER, True)
        record = MirroredTensor(tensor, is_buffer, norm_layer)
        self._records[key] = record
        self._fresh.append(record)
        if is_buffer:
            self._buffers.append(record)
        weakref.finalize(tensor, self._forget, key, record)

    def _forget(self, key: int, record: MirroredTensor) -> None:
        if self._records.get(key) is record:
            del self._records[key]
        if record.is_buffer:
            self._buffers = [b for b in self._buffers if b is not record]

    def lookup(self, tensor: Any) -> MirroredTensor | None:
        record = self._records.get(id(tensor))
        if record is not None and record.primary is tensor:
            return record
        return None

    def records(self) -> list[MirroredTensor]:
        return [r for r in list(self._records.values()) if r.primary is not None]

    # -- keeping copies equal ---------------------------------------------------------
    def sync_stale(self) -> None:
        """Broadcast copy 0 to the other replicas for every tensor changed since last sync.

        Tensors created since the last call are first made equal across workers (the chief's
        values win, whatever each worker's seed), as TF does when a variable is created.
        """
        if self._fresh:
            fresh = [r for r in self._fresh if r.primary is not None]
            self._fresh = []
            if self.worker_broadcast is not None and fresh:
                self.worker_broadcast([r.live_primary() for r in fresh])
            self.broadcast(fresh)
        if not self.replicas_on_copies:  # the only replica computes with the user's tensors
            return
        if self._relayout:
            self._relayout = False
            self._give_replica_zero_copies()
        stale = [r for r in self.records() if r.is_stale()]
        if stale:
            self.broadcast(stale)

    def _give_replica_zero_copies(self) -> None:
        """Replica 0's copy of every tensor, where it still computes with the user's tensor.
        Only copy 0 is new: the other replicas keep their copies and the gradients they hold
        (a gradient accumulated over several runs before one step)."""
        with torch.no_grad():
            for record in self.records():
                primary, copies = record.live_primary(), record.copies
                if copies and copies[0] is primary:
                    was_stale = record.is_stale()
                    copies[0] = _detached_copy(primary, self.devices[0])
                    if not was_stale:
                        record.mark_synced()
        self.copies_generation += 1

    def broadcast(self, records: Iterable[MirroredTensor]) -> None:
        """Give every replica the user's tensor's value: the tensor itself, or a copy of it."""
        on_copies = self.replicas_on_copies
        with torch.no_grad():
            for record in records:
                primary = record.live_primary()
                copies = record.copies
                if copies is None or any(
                    copies[k] is primary or copies[k].shape != primary.shape or copies[k].dtype != primary.dtype
                    for k in on_copies
                ):
                    record.copies = [
                        _detached_copy(primary, device) if k in on_copies else primary
                        for k, device in enumerate(self.devices)
                    ]
                    self.copies_generation += 1
                else:
                    for k in range(self.num_replicas):
                        if k in on_copies:
                            copies[k].copy_(primary, non_blocking=True)
                        else:
                            copies[k] = primary
                record.mark_synced()

    def aggregate_buffers(self) -> None:
        """After ``run``: buffers the replicas changed (BatchNorm statistics) are averaged.

        Floating buffers get the mean over replicas (as TF's ON_READ MEAN), integer ones
        (step counters) keep replica 0's value; then every copy holds the result.
        """
        if not self.replicas_on_copies and self.worker_mean is None:
            return
        changed = [r for r in self._buffers if r.copies and r.copies_changed()]
        if not changed:
            return
        floating = [r for r in changed if r.live_primary().is_floating_point()]
        with torch.no_grad():
            if floating and self.replicas_on_copies:
                per_replica = [[r.current_copies()[k] for r in floating] for k in range(self.num_replicas)]
                means = self.cross_device_ops.batch_reduce(ReduceOp.MEAN, per_replica, self.primary_device)
                for record, mean in zip(floating, means, strict=True):
                    record.live_primary().copy_(mean)
            for record in changed:
                primary, replica0 = record.live_primary(), record.current_copies()[0]
                if not primary.is_floating_point() and replica0 is not primary:
                    primary.copy_(replica0)  # the user's tensor takes replica 0's count
            if floating and self.worker_mean is not None:
                self.worker_mean([r.live_primary() for r in floating])
        self.broadcast(changed)

    # -- views -------------------------------------------------------------------------
    def local_copies(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        record = self.lookup(tensor)
        if record is None:
            return None
        if record.is_stale():
            self.broadcast([record])
        return tuple(record.current_copies())

    def module_replicas(self, module: nn.Module) -> tuple[nn.Module, ...] | None:
        """One module per replica, sharing storage with that replica's copies."""
        tensors = list(module.parameters()) + list(module.buffers())
        found = [self.lookup(t) for t in tensors]
        records = [r for r in found if r is not None]
        if not tensors or len(records) != len(found):
            return None
        stale = [r for r in records if r.is_stale()]
        if stale:
            self.broadcast(stale)
        replicas: list[nn.Module] = []
        for k in range(self.num_replicas):
            if k not in self.replicas_on_copies:
                replicas.append(module)
                continue
            memo: dict[int, Any] = {}
            for tensor, record in zip(tensors, records, strict=True):
                replica_tensor = record.current_copies()[k]
                if isinstance(tensor, nn.Parameter):
                    replica_tensor = nn.Parameter(replica_tensor, requires_grad=tensor.requires_grad)
                memo[id(tensor)] = replica_tensor
            replicas.append(copy.deepcopy(module, memo))
        return tuple(replicas)


def _detached_copy(primary: torch.Tensor, device: torch.device) -> torch.Tensor:
    replica = primary.detach().to(device, copy=True)
    if primary.requires_grad:
        replica.requires_grad_(True)
    return replica


class ReplicaTensorMode(TorchFunctionMode):
    """Inside one replica: replace mirrored tensors by this replica's copies in torch calls.

    With ``strict`` (more than one replica), an ``nn.Parameter`` that is not mirrored means a
    module was made outside ``strategy.scope()``: training it would silently diverge, so it
    raises ``UnmirroredStateError``. ``torch.compile`` traces through this mode, so a compiled
    module or step computes with each replica's copies: the graph reads them from the mode of
    the thread that runs it, as inputs, and replicas on one device can share it (the fake
    parameters dynamo makes while tracing are let through).
    """

    def __init__(self, state: ReplicatedState, local_replica_id: int, strict: bool):
        super().__init__()
        # A replica that computes with the user's tensors themselves swaps nothing. Under
        # torch.compile dynamo guards on this flag, so a replica on copies never runs a graph
        # traced by one on the user's tensors (whose graph holds those as module parameters).
        self._passthrough = local_replica_id not in state.replicas_on_copies
        # Built once per run: primary id -> (primary, this replica's copy). Holding the primary
        # makes the identity check exact (an id is never reused while the pair is held).
        self._table = {
            id(r.primary): (r.primary, r.copies[local_replica_id])
            for r in state.records()
            if r.copies is not None
        }
        self._strict = strict
        self._num_replicas = state.num_replicas

    def _swap(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            # Only parameters and marked buffers can be mirrored: asking for any other tensor's
            # id would make torch.compile guard on it and recompile for every new batch.
            if not (isinstance(value, nn.Parameter) or getattr(value, MIRRORED_BUFFER, False)):
                return value
            entry = self._table.get(id(value))
            if entry is not None and entry[0] is value:
                return entry[1]
            if self._strict and isinstance(value, nn.Parameter) and not is_fake(value):
                raise UnmirroredStateError(
                    f"A parameter of shape {tuple(value.shape)} that was not registered on a "
                    "module inside strategy.scope() is used inside strategy.run() with "
                    f"{self._num_replicas} replicas; its replicas would silently train apart. "
                    "Create the module (and its optimizer) inside `with strategy.scope():` "
                    "(a bare nn.Parameter must be assigned to a module there). A module loaded "
                    "whole (torch.load, torch.jit.load) registers nothing, even inside the scope: "
                    "build it there and load the saved weights with module.load_state_dict(...)."
                )
            return value
        if type(value) in (list, tuple):
            return type(value)(self._swap(v) for v in value)
        return value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self._passthrough:
            return func(*args, **(kwargs or {}))
        args = tuple(self._swap(a) for a in args)
        if kwargs:
            kwargs = {k: self._swap(v) for k, v in kwargs.items()}
        else:
            kwargs = {}
        return func(*args, **kwargs)
