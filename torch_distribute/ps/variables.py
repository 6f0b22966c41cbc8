"""Parameters held by the parameter servers: layouts (coordinator/worker side) and shards (PS side).

A *variable* is one parameter or buffer made in ``ParameterServerStrategy.scope()``; it has a
``VarSpec``: shape, dtype and its shards, each a row range ``[start, stop)`` stored on one
parameter server under a cluster-unique shard id. The PS keeps each shard in ``_SHARDS`` with
its own optimizer (built from the class and hyperparameters of the coordinator's optimizer),
so an update needs no other task: workers push gradients and never wait for each other.

The functions ``read``, ``apply_gradients``, ``add``, ``assign``, ... are the RPC targets a
parameter server answers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from torch_distribute.ps import transport


@dataclass(frozen=True)
class ShardSpec:
    ps_index: int
    shard_id: int
    start: int
    stop: int


@dataclass(frozen=True)
class VarSpec:
    var_id: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_param: bool
    requires_grad: bool
    shards: tuple[ShardSpec, ...]

    def rows(self, tensor: torch.Tensor, shard: ShardSpec) -> torch.Tensor:
        """The part of a full-size ``tensor`` that ``shard`` holds (all of it when unsharded)."""
        if len(self.shards) == 1:
            return tensor
        return tensor[shard.start:shard.stop]

    def new_local(self) -> torch.Tensor:
        tensor = torch.zeros(self.shape, dtype=self.dtype)
        return torch.nn.Parameter(tensor, self.requires_grad) if self.is_param else tensor


# -- parameter-server side --------------------------------------------------------------
class _Shard:
    __slots__ = ("lock", "optimizer", "tensor")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.optimizer: torch.optim.Optimizer | None = None
        self.lock = threading.Lock()


_SHARDS: dict[int, _Shard] = {}
_registry_lock = threading.Lock()


def _shard(shard_id: int) -> _Shard:
    try:
        return _SHARDS[shard_id]
    except KeyError:
        raise KeyError(f"this parameter server holds no shard {shard_id}") from None


def create(items: list[tuple[int, torch.Tensor, bool]]) -> None:
    """Create (or replace the value of) shards: ``(shard_id, value, requires_grad)``."""
    with _registry_lock:
        for shard_id, value, requires_grad in items:
            existing = _SHARDS.get(shard_id)
            if existing is not None:
                with existing.lock, torch.no_grad():
                    existing.tensor.copy_(value)
                continue
            tensor = value.detach().clone()
            if requires_grad:
                tensor = torch.nn.Parameter(tensor)
            _SHARDS[shard_id] = _Shard(tensor)


def assign(items: list[tuple[int, torch.Tensor]]) -> None:
    create([(shard_id, value, False) for shard_id, value in items])


def read(shard_ids: list[int]) -> list[torch.Tensor]:
    out = []
    for shard_id in shard_ids:
        shard = _shard(shard_id)
        with shard.lock:
            out.append(shard.tensor.detach().clone())
    return out


def add(items: list[tuple[int, torch.Tensor]]) -> None:
    """``shard += delta`` (buffers such as BatchNorm statistics or counters)."""
    for shard_id, delta in items:
        shard = _shard(shard_id)
        with shard.lock, torch.no_grad():
            shard.tensor.add_(delta.to(shard.tensor.dtype))


def set_optimizer(shard_ids: list[int], optimizer_class: type, hyperparameters: dict[str, Any]) -> None:
    """Give each shard its own ``optimizer_class([shard], **hyperparameters)``."""
    for shard_id in shard_ids:
        shard = _shard(shard_id)
        with shard.lock:
            shard.optimizer = optimizer_class([shard.tensor], **hyperparameters)


def set_hyperparameters(shard_ids: list[int], hyperparameters: dict[str, Any]) -> None:
    for shard_id in shard_ids:
        shard = _shard(shard_id)
        with shard.lock:
            if shard.optimizer is not None:
                shard.optimizer.param_groups[0].update(hyperparameters)


def apply_gradients(items: list[tuple[int, torch.Tensor]]) -> None:
    """One optimizer step per shard with the pushed gradient (no optimizer: plain SGD, lr 1)."""
    for shard_id, grad in items:
        shard = _shard(shard_id)
        with shard.lock:
            if shard.optimizer is None:
                with torch.no_grad():
                    shard.tensor.sub_(grad)
                continue
            shard.tensor.grad = grad
            shard.optimizer.step()
            shard.tensor.grad = None


def optimizer_state(shard_ids: list[int]) -> list[dict[str, Any]]:
    """Each shard's optimizer state (``{}`` before its first step): tensors cloned."""
    out = []
    for shard_id in shard_ids:
        shard = _shard(shard_id)
        with shard.lock:
            state = shard.optimizer.state.get(shard.tensor, {}) if shard.optimizer is not None else {}
            out.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()})
    return out


def load_optimizer_state(items: list[tuple[int, dict[str, Any]]]) -> None:
    for shard_id, state in items:
        shard = _shard(shard_id)
        with shard.lock:
            if shard.optimizer is None:
                continue
            shard.optimizer.state[shard.tensor] = {
                k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def clear() -> None:
    """Forget every shard (tests)."""
    with _registry_lock:
        _SHARDS.clear()


transport.entry_points(create, assign, read, add, set_optimizer, set_hyperparameters, apply_gradients,
                       optimizer_state, load_optimizer_state)
