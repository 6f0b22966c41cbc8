"""A ``td.keras.Model``'s weights as arrays and files, and the whole-model file ``Model.save`` writes.

The ``Model`` methods of the same names call these with the model's ``weights_module`` (the
wrapped module, or the model itself) and its optimizer. Every file is a ``td.Checkpoint``
file; ``save_model`` adds the ``"keras_model"`` record (``keras.saving`` encodes it,
``keras.models.load_model`` reads it back).

>>> import torch
>>> linear = torch.nn.Linear(2, 1)
>>> [w.shape for w in get_weights(linear)]
[(1, 2), (1,)]
>>> set_weights(linear, [w * 0 for w in get_weights(linear)])
>>> float(linear.weight.detach().sum())
0.0
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from torch_distribute.checkpoint import Checkpoint
from torch_distribute.errors import InvalidArgumentError
from torch_distribute.keras import saving
from torch_distribute.keras.compile_config import CompileConfig
from torch_distribute.mixed_precision import LossScaleOptimizer

__all__ = ["get_weights", "load_weights", "save_model", "save_weights", "set_weights"]

Optimizer = torch.optim.Optimizer | LossScaleOptimizer


def _weight_names(module: nn.Module) -> list[list[str]]:
    """The state_dict's names, one list per tensor (tied weights are one tensor), in order."""
    groups: dict[int, list[str]] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        groups.setdefault(id(value), []).append(name)
    return list(groups.values())


def get_weights(module: nn.Module) -> list[np.ndarray]:
    """Every weight of ``module`` as a numpy array, in ``state_dict`` order (tied weights once);
    a sharded tensor (``DTensor``) whole."""
    state = module.state_dict()
    arrays = []
    for names in _weight_names(module):
        tensor = state[names[0]]
        full = getattr(tensor, "full_tensor", None)
        arrays.append((full() if callable(full) else tensor).detach().cpu().numpy().copy())  # not a view
    return arrays


def set_weights(module: nn.Module, weights: Sequence[npt.ArrayLike]) -> None:
    """Set every weight of ``module`` from arrays in ``get_weights``' order and shapes, through a
    ``Checkpoint`` load (so every replica or shard gets them)."""
    groups = _weight_names(module)
    if isinstance(weights, (str, bytes)) or len(weights) != len(groups):
        raise InvalidArgumentError(
            f"set_weights expects {len(groups)} arrays (get_weights' order), got "
            f"{len(weights) if not isinstance(weights, (str, bytes)) else type(weights).__name__}.")
    state = module.state_dict()
    values: dict[str, torch.Tensor] = {}
    for names, array in zip(groups, weights, strict=True):
        current = state[names[0]]
        value = torch.as_tensor(array).to(dtype=current.dtype)
        if tuple(value.shape) != tuple(current.shape):
            raise InvalidArgumentError(
                f"set_weights: {names[0]} has shape {tuple(current.shape)}, got an array of shape "
                f"{tuple(value.shape)}.")
        values.update(dict.fromkeys(names, value))
    Checkpoint(model=module).load_state_dict({"save_counter": 0, "objects": {"model": values}})


def save_weights(module: nn.Module, optimizer: Optimizer | None, filepath: str) -> str:
    """Write ``module``'s weights (and ``optimizer``'s state, unless ``None``) to ``filepath``."""
    objects: dict[str, object] = {"model": module}
    if optimizer is not None:
        objects["optimizer"] = optimizer
    return Checkpoint(**objects).write(filepath)


def load_weights(module: nn.Module, optimizer: Optimizer | None, filepath: str) -> None:
    """Read ``filepath`` into ``module`` (and ``optimizer``, when given and the file holds its state)."""
    objects: dict[str, object] = {"model": module}
    if optimizer is not None:
        objects["optimizer"] = optimizer  # left as it is when the file has no optimizer
    Checkpoint(**objects).read(filepath)


def save_model(model: nn.Module, weights_module: nn.Module, filepath: str | os.PathLike[str], *,
               overwrite: bool, optimizer: Optimizer | None, compile_config: CompileConfig | None) -> str:
    """Write ``model`` (a ``td.keras.Model``) whole: its architecture, ``weights_module``'s
    weights and, when ``compile_config`` is given, the optimizer and its state and
    ``compile``'s arguments (``Model.save`` says more)."""
    filepath = os.fspath(filepath)
    if not overwrite and os.path.exists(filepath):
        raise InvalidArgumentError(f"{filepath!r} exists and overwrite=False: pass overwrite=True or another path.")
    record: dict[str, object] = {"model": saving.encode(model, f"the model {type(model).__qualname__}"),
                                 "compile": None, "optimizer": None}
    objects: dict[str, object] = {"model": weights_module}
    if compile_config is not None:
        try:
            record["compile"] = saving.encode(compile_config.saved_arguments(), "compile()'s arguments")
            record["optimizer"] = saving.optimizer_record(optimizer, model.named_parameters())
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(
                f"{exc} Or save with include_optimizer=False: the weights and the architecture only "
                "(compile again after loading)."
            ) from exc
        objects["optimizer"] = optimizer
    objects["keras_model"] = saving.ConfigRecord(record)
    return Checkpoint(**objects).write(filepath)
