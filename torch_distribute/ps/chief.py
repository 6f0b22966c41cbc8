"""The coordinator's side of the variables: what was made in scope, where it lives, and the
descriptions workers fetch.

``ChiefRegistry`` records every parameter and buffer made in ``scope()``, places it (shards
round-robin over the parameter servers, TensorFlow's order) and ships its initial value when
the scope is left. The coordinator's modules keep full-size local tensors: the refresh hook
reads the servers' values into them before ``forward``/``state_dict`` whenever a scheduled
function may have changed them, and local changes (``load_state_dict``, in-place edits,
noticed through the tensor's version counter) are written to the servers first.

Workers call ``describe`` (an RPC target) to fetch what a reference in a scheduled
function's payload stands for.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torch_distribute.errors import InvalidArgumentError
from torch_distribute.partitioners import shard_offsets
from torch_distribute.ps import client, hooks, pickling, transport
from torch_distribute.ps.variables import ShardSpec, VarSpec


@dataclass
class _Var:
    spec: VarSpec | None  # None until shipped (values are set after registration)
    tensor: torch.Tensor
    is_buffer: bool
    version: int = -1

    @property
    def shipped_spec(self) -> VarSpec:
        """``spec``, once shipped (every variable read or written on the servers is)."""
        assert self.spec is not None, "a variable is used on the servers before it is shipped"
        return self.spec


class ChiefRegistry:
    def __init__(self, num_ps: int, partitioner: Callable[..., Any] | None, timeout: float):
        self.num_ps = num_ps
        self.partitioner = partitioner
        self.timeout = timeout
        self._lock = threading.RLock()
        self._vars: dict[int, _Var] = {}  # id(tensor) -> var
        self._by_var_id: dict[int, _Var] = {}
        self._pending: list[_Var] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._pending_optimizers: list[torch.optim.Optimizer] = []
        self._shipped_hyper: dict[int, list[dict[str, Any]]] = {}
        self._objects: dict[int, Any] = {}
        self._object_ids: dict[int, int] = {}
        self._blobs: dict[int, tuple[Any, ...]] = {}
        self._recipes: dict[int, tuple[Any, ...]] = {}
        self._next_var = 0
        self._next_shard = 0
        self._placement = 0
        self._next_object = 0
        self._stale = False

    # -- capture --------------------------------------------------------------------------
    def capture(self, tensor: torch.Tensor, is_buffer: bool) -> None:
        with self._lock:
            if id(tensor) in self._vars:
                return
            var = _Var(None, tensor, is_buffer)
            self._vars[id(tensor)] = var
            self._pending.append(var)
            weakref.finalize(tensor, self._vars.pop, id(tensor), None)

    def capture_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        with self._lock:
            self._pending_optimizers.append(optimizer)

    def _num_shards(self, tensor: torch.Tensor) -> int:
        if self.partitioner is None or tensor.dim() == 0:
            return 1
        partitions = list(self.partitioner(tuple(tensor.shape), tensor.dtype))
        if not partitions or partitions[0] < 1 or any(p != 1 for p in partitions[1:]):
            raise InvalidArgumentError(
                "variable_partitioner must return a list whose elements are 1 besides the first "
                f"(a positive number of shards along dim 0), got {partitions!r} for shape "
                f"{tuple(tensor.shape)}."
            )
        return min(partitions[0], tensor.shape[0]) if tensor.shape[0] else 1

    def _place(self, var: _Var) -> VarSpec:
        tensor = var.tensor
        num_shards = self._num_shards(tensor)
        offsets = shard_offsets(tensor.shape[0], num_shards) if num_shards > 1 else [0, 0]
        shards = []
        for k in range(num_shards):
            shards.append(ShardSpec(self._placement % self.num_ps, self._next_shard, offsets[k], offsets[k + 1]))
            self._placement += 1
            self._next_shard += 1
        spec = VarSpec(self._next_var, tuple(tensor.shape), tensor.dtype, not var.is_buffer,
                       bool(tensor.requires_grad), tuple(shards))
        self._next_var += 1
        return spec

    def materialize(self) -> None:
        """Place and ship what was created since the last call (values are final by now)."""
        with self._lock:
            pending, self._pending = [v for v in self._pending if id(v.tensor) in self._vars], []
            for var in pending:
                var.spec = self._place(var)
                self._by_var_id[var.spec.var_id] = var
            if pending:
                client.create([v.shipped_spec for v in pending], [v.tensor for v in pending], self.timeout)
                for var in pending:
                    var.version = var.tensor._version
            optimizers, self._pending_optimizers = self._pending_optimizers, []
            for optimizer in optimizers:
                self._ship_optimizer(optimizer)
                self._optimizers.append(optimizer)

    # -- lookups ----------------------------------------------------------------------------
    def spec_of(self, tensor: object) -> VarSpec | None:
        var = self._vars.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        return var.spec if var is not None and var.tensor is tensor else None

    def owns(self, tensor: object) -> bool:
        var = self._vars.get(id(tensor))
        return var is not None and var.tensor is tensor

    def _object_id(self, obj: Any) -> int:
        with self._lock:
            oid = self._object_ids.get(id(obj))
            if oid is None or self._objects.get(oid) is not obj:
                oid = self._next_object
                self._next_object += 1
                self._objects[oid] = obj
                self._object_ids[id(obj)] = oid
            return oid

    def register_recipe(self, recipe: tuple[Any, ...]) -> int:
        """A per-worker resource built lazily on each worker: returns its id."""
        with self._lock:
            oid = self._next_object
            self._next_object += 1
            self._recipes[oid] = recipe
            return oid

    # -- references -----------------------------------------------------------------------
    def payload_reference(self, obj: Any) -> pickling.Reference | None:
        """What a scheduled function's argument pickles as (None: by value)."""
        if isinstance(obj, torch.Tensor):
            spec = self.spec_of(obj)
            return ("var", spec.var_id, spec) if spec is not None else None
        if isinstance(obj, nn.Module):
            tensors = [*obj.parameters(), *obj.buffers()]
            if any(self.owns(t) for t in tensors):
                return ("module", self._object_id(obj))
            if any(True for _ in obj.parameters()):
                raise InvalidArgumentError(
                    f"The {type(obj).__name__} passed to schedule() was not created inside "
                    "strategy.scope(), so its parameters are not on the parameter servers. "
                    "Create it inside `with strategy.scope():`."
                )
            return None
        if isinstance(obj, torch.optim.Optimizer):
            if obj in self._optimizers or obj in self._pending_optimizers:
                return ("optimizer", self._object_id(obj))
            raise InvalidArgumentError(
                f"The {type(obj).__name__} passed to schedule() was not created inside "
                "strategy.scope(); create the optimizer inside `with strategy.scope():` so its "
                "updates run on the parameter servers."
            )
        reference = getattr(type(obj), "td_reference", None)  # RemoteValue, PerWorkerValues, ...
        return reference(obj) if reference is not None and not isinstance(obj, type) else None

    def _blob_reference(self, obj: Any) -> pickling.Reference | None:
        if isinstance(obj, torch.Tensor):
            spec = self.spec_of(obj)
            return ("var", spec.var_id, spec) if spec is not None else None
        return None

    def describe(self, key: tuple[Any, ...], worker_index: int) -> tuple[Any, ...]:
        """What reference ``key`` stands for, for worker ``worker_index`` (RPC target)."""
        kind, oid = key[0], key[1]
        if kind == "module":
            with self._lock:
                blob = self._blobs.get(oid)
                if blob is None:
                    module = self._objects[oid]
                    data = pickling.dumps(module, self._blob_reference, f"the {type(module).__name__}")
                    var_ids = sorted({self.spec_of(t).var_id for t in [*module.parameters(), *module.buffers()]
                                      if self.spec_of(t) is not None})
                    blob = self._blobs[oid] = ("module", data, var_ids)
            return blob
        if kind == "optimizer":
            optimizer = self._objects[oid]
            groups = [[self.spec_of(p) for p in group["params"]] for group in optimizer.param_groups]
            return ("optimizer", groups)
        if kind == "per_worker":
            recipe = self._recipes[oid]
            if recipe[0] == "values":
                return ("value", recipe[1][worker_index])
            return recipe
        raise KeyError(f"unknown reference {key!r}")

    # -- keeping coordinator and servers in step ------------------------------------------
    def mark_stale(self) -> None:
        self._stale = True

    def push_local_changes(self) -> None:
        """Write tensors changed on the coordinator (load_state_dict, in-place edits)."""
        with self._lock:
            self.materialize()
            changed = [v for v in self._by_var_id.values()
                       if id(v.tensor) in self._vars and v.tensor._version != v.version]
            if changed:
                client.assign([v.shipped_spec for v in changed], [v.tensor for v in changed], self.timeout)
                for var in changed:
                    var.version = var.tensor._version

    def refresh(self) -> None:
        """Before forward/state_dict on the coordinator: local changes out, then fresh values in."""
        if not self._stale and not self._pending:
            return
        with self._lock:
            self.push_local_changes()
            if self._stale:
                self._stale = False
                live = [v for v in self._by_var_id.values() if id(v.tensor) in self._vars]
                client.pull([v.shipped_spec for v in live], [v.tensor for v in live], self.timeout)
                for var in live:
                    var.version = var.tensor._version

    # -- optimizers ---------------------------------------------------------------------------
    def _hyperparameters(self, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
        keys = set(optimizer.defaults)
        return [{k: v for k, v in group.items() if k in keys} for group in optimizer.param_groups]

    def _grouped_specs(self, optimizer: torch.optim.Optimizer) -> list[tuple[VarSpec, int]]:
        out = []
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                out.append((self._optimized_spec(optimizer, p), g))
        return out

    def _optimized_spec(self, optimizer: torch.optim.Optimizer, param: torch.Tensor) -> VarSpec:
        spec = self.spec_of(param)
        if spec is None:
            raise InvalidArgumentError(
                f"{type(optimizer).__name__} holds a parameter that was not created in "
                "ParameterServerStrategy.scope(); build the model inside the scope too."
            )
        return spec

    def _ship_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        hyper = self._hyperparameters(optimizer)
        pairs = self._grouped_specs(optimizer)
        client.set_optimizer([s for s, _ in pairs], type(optimizer), [hyper[g] for _, g in pairs], self.timeout)
        self._shipped_hyper[id(optimizer)] = hyper

    def sync_hyperparameters(self) -> None:
        """Send learning-rate (or other hyperparameter) changes made on the coordinator."""
        with self._lock:
            for optimizer in self._optimizers:
                hyper = self._hyperparameters(optimizer)
                if hyper != self._shipped_hyper.get(id(optimizer)):
                    pairs = self._grouped_specs(optimizer)
                    client.set_hyperparameters([s for s, _ in pairs], [hyper[g] for _, g in pairs], self.timeout)
                    self._shipped_hyper[id(optimizer)] = hyper

    def manages(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s state lives on the servers (shipped when the scope was left)."""
        return any(o is optimizer for o in self._optimizers)

    def attach_optimizer_hooks(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.state_dict()``/``load_state_dict()`` on the coordinator read and
        write the servers' per-shard state, with torch's own optimizer hooks."""
        loading: dict[str, Any] = {}

        def before_save(opt: torch.optim.Optimizer) -> None:
            if self.manages(opt):
                self.materialize()

        def after_save(opt: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any] | None:
            if not self.manages(opt):
                return None
            pairs = self._grouped_specs(opt)
            states = client.optimizer_states([s for s, _ in pairs], self.timeout)
            state["state"] = {index: s for index, s in enumerate(states) if s}
            return state

        def before_load(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any] | None:
            if not self.manages(opt):
                return None
            self.materialize()
            loading["saved"] = state_dict.get("state", {})
            return {**state_dict, "state": {}}

        def after_load(opt: torch.optim.Optimizer) -> None:
            saved = loading.pop("saved", {})
            if not self.manages(opt):
                return
            self.sync_hyperparameters()
            pairs = self._grouped_specs(opt)
            states = [saved.get(index, saved.get(str(index), {})) for index in range(len(pairs))]
            client.load_optimizer_states([s for s, _ in pairs], states, self.timeout)

        optimizer.register_state_dict_pre_hook(before_save)
        optimizer.register_state_dict_post_hook(after_save)
        optimizer.register_load_state_dict_pre_hook(before_load)
        optimizer.register_load_state_dict_post_hook(after_load)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` called on the coordinator: push its local gradients."""
        self.push_local_changes()
        pairs = [(self._optimized_spec(optimizer, p), p.grad) for group in optimizer.param_groups
                 for p in group["params"] if p.grad is not None]
        if pairs:
            client.push_gradients([s for s, _ in pairs], [g for _, g in pairs], self.timeout)
        self.mark_stale()


_registry: ChiefRegistry | None = None


def install(registry: ChiefRegistry | None) -> None:
    global _registry
    _registry = registry
    hooks.set_refresher(registry.refresh if registry is not None else None)


def current_registry() -> ChiefRegistry | None:
    """This process's registry when it is the coordinator of a ParameterServerStrategy."""
    return _registry


def describe(key: tuple[Any, ...], worker_index: int) -> tuple[Any, ...]:
    """RPC target on the coordinator: what a reference stands for."""
    if _registry is None:
        raise RuntimeError("this task is not the coordinator of a ParameterServerStrategy")
    return _registry.describe(key, worker_index)


transport.entry_points(describe)
