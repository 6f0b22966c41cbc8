"""Capture what is created inside ``strategy.scope()``.

Parameters and buffers are caught with torch's global registration hooks; optimizers and LR
schedulers by a thin wrapper around their ``__init__``. Outside any scope the hooks return at
once, so they cost nothing to code that does not use a strategy.
"""

from __future__ import annotations

import functools
import threading
import types
import weakref
from typing import Any

import torch
from torch.nn.modules import module as nn_module
from torch.nn.modules.batchnorm import _NormBase
from torch.optim import lr_scheduler
from torch.optim import optimizer as optimizer_module

from torch_distribute import context
from torch_distribute.errors import UnmirroredStateError

_installed = False
_install_lock = threading.Lock()
_strategies: weakref.WeakSet[Any] = weakref.WeakSet()


def register_strategy(strategy: Any) -> None:
    _strategies.add(strategy)


def owner_of(obj: Any) -> Any | None:
    """The (non-default) strategy an object made in a scope belongs to, if any.

    Optimizers and metrics know theirs; a module or tensor belongs to the strategy whose
    scope registered its parameters.
    """
    owner = getattr(obj, "_td_strategy", None) or getattr(obj, "_strategy", None)
    if owner is not None and not getattr(owner, "_is_default", True):
        return owner
    tensors: list[Any] = []
    if isinstance(obj, torch.nn.Module):
        tensors = [*obj.parameters(), *obj.buffers()][:1]
    elif isinstance(obj, torch.Tensor):
        tensors = [obj]
    for tensor in tensors:
        for strategy in list(_strategies):
            if not strategy._is_default and strategy.extended._state.lookup(tensor) is not None:
                return strategy
    return None


def _scope_strategy() -> Any | None:
    """The strategy whose scope we are directly in (not inside run), if any."""
    strategy = context.get_cross_replica_context()
    if strategy is None or strategy._is_default:
        return None
    return strategy


def _on_parameter(module: torch.nn.Module, name: str, param: Any) -> Any:
    strategy = _scope_strategy()
    if strategy is None or param is None:
        return None
    return strategy.extended._capture_parameter(param, is_buffer=False)


def _on_buffer(module: torch.nn.Module, name: str, buffer: Any) -> Any:
    strategy = _scope_strategy()
    if strategy is None or buffer is None:
        return None
    is_running_stat = isinstance(module, _NormBase) and name in ("running_mean", "running_var")
    return strategy.extended._capture_parameter(
        buffer, is_buffer=True, norm_layer=module if is_running_stat else None
    )


def _wrap_optimizer_init(original: Any) -> Any:
    @functools.wraps(original)
    def __init__(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        strategy = _scope_strategy()
        if strategy is not None and getattr(self, "_td_strategy", None) is None:
            self._td_strategy = strategy
            strategy.extended._capture_optimizer(self)

    return __init__


def _wrap_scheduler_init(original: Any) -> Any:
    @functools.wraps(original)
    def __init__(self: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        original(self, optimizer, *args, **kwargs)
        strategy = getattr(optimizer, "_td_strategy", None)
        if strategy is not None and strategy.num_replicas_in_sync > 1:
            self.step = types.MethodType(_scheduler_step(type(self).step), self)

    return __init__


def _scheduler_step(original_step: Any) -> Any:
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        replica = context.get_replica_context()
        if replica is None or replica.num_replicas_in_sync == 1:
            return original_step(self, *args, **kwargs)
        # Every replica calls scheduler.step(); it must advance once per training step.
        return replica.merge_call(lambda _strategy: original_step(self, *args, **kwargs))

    return step


def _check_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    replica = context.get_replica_context()
    if (
        replica is not None
        and replica.num_replicas_in_sync > 1
        and getattr(optimizer, "_td_strategy", None) is None
    ):
        raise UnmirroredStateError(
            f"{type(optimizer).__name__}.step() was called inside strategy.run() with "
            f"{replica.num_replicas_in_sync} replicas, but the optimizer was created outside "
            "strategy.scope(): gradients would not be summed across replicas. Create the "
            "optimizer inside `with strategy.scope():`."
        )


def install() -> None:
    """Install the hooks once per process (idempotent, thread-safe)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        nn_module.register_module_parameter_registration_hook(_on_parameter)
        nn_module.register_module_buffer_registration_hook(_on_buffer)
        torch.optim.Optimizer.__init__ = _wrap_optimizer_init(torch.optim.Optimizer.__init__)
        lr_scheduler.LRScheduler.__init__ = _wrap_scheduler_init(lr_scheduler.LRScheduler.__init__)
        optimizer_module.register_optimizer_step_pre_hook(_check_optimizer_step)
        _installed = True
