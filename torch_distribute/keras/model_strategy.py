"""Which strategy a ``td.keras.Model`` belongs to, and the checks that keep it so.

A model belongs to the strategy whose scope its parameters were made in, else to the one
whose scope it was made in. ``adopt`` hands a module made elsewhere (``torch.load``,
``load_model`` outside every scope) to the strategy in scope; ``owning_strategy`` and
``check_called_in_scope`` run at every ``compile``/``fit``/``evaluate``/``predict``.

>>> import torch, torch_distribute as td
>>> strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
>>> with strategy.scope():
...     linear = torch.nn.Linear(2, 1)
>>> owning_strategy("linear", td.get_strategy(), linear.parameters()) is strategy
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from torch_distribute import context
from torch_distribute.errors import ContextError, InvalidArgumentError, UnmirroredStateError
from torch_distribute.strategies import Strategy, owner_of
from torch_distribute.strategies.interception import capture_module

__all__ = ["adopt", "check_called_in_scope", "owning_strategy", "scope_of"]


def adopt(module: object) -> None:
    """Check that ``module`` can train, and hand it to the strategy whose scope we are in when
    it was made elsewhere (``torch.load`` of a whole module, ``load_model`` outside the scope)."""
    if isinstance(module, torch.export.ExportedProgram) or (isinstance(module, nn.Module) and not _trains(module)):
        raise InvalidArgumentError(
            f"td.keras.Model cannot train a {type(module).__name__} (an ExportedProgram, or its .module(), is a "
            "graph for inference: it does not support train()). To fine-tune, rebuild the module and load the "
            "weights into it: module.load_state_dict(torch.export.load(path).module().state_dict()), or save "
            "the model with model.save(path) and load it with td.keras.models.load_model(path).")
    if not isinstance(module, nn.Module):
        raise InvalidArgumentError(f"td.keras.Model wraps a torch.nn.Module, got {type(module).__name__}.")
    first = next(iter([*module.parameters(), *module.buffers()]), None)
    if first is not None and owner_of(first) is None and not isinstance(module, torch.jit.ScriptModule):
        capture_module(module)  # nothing outside every scope


def _trains(module: nn.Module) -> bool:
    """Whether ``module.train()`` works (an exported program's module raises)."""
    try:
        module.train(module.training)
    except NotImplementedError:
        return False
    return True


def owning_strategy(model_name: str, strategy: Strategy, tensors: Iterable[torch.Tensor]) -> Strategy:
    """The strategy a model made under ``strategy`` with these parameters and buffers belongs
    to: the owner of its tensors when it was made under the default strategy. Raises when
    they belong to another strategy, or to none while ``strategy`` has several replicas."""
    first = next(iter(tensors), None)
    owner = owner_of(first) if first is not None else None
    if owner is not None and strategy.is_default:
        return cast(Strategy, owner)
    if owner is not None and owner is not strategy:
        raise ContextError(
            f"{model_name}'s parameters belong to {type(owner).__name__} but the model was wrapped under "
            f"{type(strategy).__name__}; create the module and the td.keras.Model in the same scope."
        )
    if first is not None and owner is None and strategy.num_replicas_in_sync > 1:
        raise UnmirroredStateError(
            f"{model_name} was created outside strategy.scope() but is used with "
            f"{type(strategy).__name__} ({strategy.num_replicas_in_sync} replicas): create the module "
            "inside `with strategy.scope():`, or wrap a module made or loaded elsewhere (torch.load, "
            "load_model, copy.deepcopy) inside the scope: `with strategy.scope(): model = "
            "td.keras.Model(module)` hands it to the strategy. A TorchScript module (torch.jit.load) "
            "cannot be handed over: build the module in the scope and load its weights "
            "(module.load_state_dict(scripted.state_dict()))."
        )
    return strategy


def check_called_in_scope(model_name: str, strategy: Strategy) -> None:
    """Refuse a call made in the scope of a strategy other than the model's own."""
    if context.has_strategy() and context.get_strategy() is not strategy:
        raise ContextError(
            f"{model_name} belongs to {type(strategy).__name__} but compile/fit was called in the scope of "
            f"{type(context.get_strategy()).__name__}; call it in the model's own scope or outside any scope."
        )


def scope_of(strategy: Strategy) -> contextlib.AbstractContextManager[object]:
    """``strategy.scope()``, or nothing to enter for the default strategy."""
    return contextlib.nullcontext() if strategy.is_default else strategy.scope()
