"""How a ``td.keras.Model`` is recorded in a saved-model file and rebuilt from it (``td.keras.saving``).

A saved model is one ``td.Checkpoint`` file (checksummed, written collectively, loaded with
``weights_only=True``: nothing in it is code). Besides the weights (``"model"``, the
``state_dict`` that ``save_weights`` writes) and the optimizer state (``"optimizer"``), it
holds ``"keras_model"``: plain values naming every class and function by import path
(``"package.module:QualName"``) with the arguments to rebuild it:

- the model: a ``td.keras.Model`` subclass by its constructor arguments, recorded when it
  was made (or by ``get_config()`` where the class defines one; rebuilt with
  ``from_config(config)`` when the class has it, else ``cls(**config)``); ``Model(module)``
  by the wrapped module: by its ``get_config()`` if its class has one, else by its class,
  attributes, submodules and parameter shapes (``module_records``: ``nn.Sequential``,
  ``ModuleList``, every ``torch.nn`` layer, your own modules);
- the optimizer: its ``torch.optim`` class, its hyper-parameters and its parameter groups
  (by parameter name), and the loss-scale wrapper's settings;
- ``compile``'s arguments: names, numbers, importable functions, ``td.keras.optimizers``
  specs, ``td.keras.losses`` function wrappers, and objects with ``get_config()``.

Loading resolves every name through an ``allowlist.Resolver`` (``safe_mode``,
``custom_objects``, ``register_serializable``) before building anything. What cannot be
named by import path (a lambda, a class defined inside a function) raises
``InvalidArgumentError`` at save time, saying what to change; a class of ``__main__`` is
saved by name and loads in a program that defines it (``custom_objects``).

>>> encode({"loss": "mse", "weights": (1.0, 0.5)}, "compile")
{'loss': 'mse', 'weights': (1.0, 0.5)}
>>> import_path(encode)
'torch_distribute.keras.saving:encode'
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from typing import Any

import torch

from torch_distribute import metrics as td_metrics
from torch_distribute.errors import InvalidArgumentError
from torch_distribute.keras import losses as losses_module
from torch_distribute.keras import module_records
from torch_distribute.keras import optimizers as optimizers_module
from torch_distribute.keras.allowlist import Resolver, register_serializable, registered_objects
from torch_distribute.keras.mixed_precision import Policy
from torch_distribute.mixed_precision import LossScaleOptimizer

__all__ = ["ConfigRecord", "Resolver", "build_optimizer", "decode", "encode", "import_path", "named_paths",
           "optimizer_record", "register_serializable", "registered_objects", "resolve"]

_TAG = "__td_keras__"
_PRIMITIVES = (str, int, float, bool, type(None), torch.Tensor)


class ConfigRecord:
    """A checkpoint object holding plain values (``state_dict``/``load_state_dict``)."""

    def __init__(self, value: dict[str, Any] | None = None):
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return dict(self.value or {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state


def import_path(obj: Any, what: str | None = None) -> str:
    """``"module:qualname"`` of a class or function that importing finds again, else raise."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    what = what or f"{getattr(obj, '__qualname__', type(obj).__name__)}"
    problem = None
    if module is None or qualname is None:
        problem = "it has no module and qualified name"
    elif "<lambda>" in qualname or "<locals>" in qualname:
        problem = "it is a lambda or defined inside a function"
    else:
        try:
            found = resolve(f"{module}:{qualname}")
        except Exception:  # noqa: BLE001 - any import failure means the same to the user
            found = None
        if found is not obj:
            problem = f"importing {module}:{qualname} does not give it back"
    if problem is not None:
        raise InvalidArgumentError(
            f"Cannot save {what}: a saved model names every class and function by import path, and {problem}. "
            "Define it at the top level of an importable module or of the script, or pass a name "
            "('mse', 'accuracy', 'adam')."
        )
    return f"{module}:{qualname}"


def resolve(path: str) -> Any:
    """The class or function named ``"module:qualname"`` (imports the module)."""
    module_name, _, qualname = path.partition(":")
    value: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


def _module_class(value: Any) -> type:
    return module_records.module_class(value) if isinstance(value, torch.nn.Module) else type(value)


def _takes_only_a_name(cls: type) -> bool:
    """Whether ``cls(name=...)`` rebuilds an instance (a metric with no other argument)."""
    parameters = inspect.signature(cls).parameters
    return set(parameters) - {"self"} <= {"name", "dtype"} and "name" in parameters


def _tagged(kind: str, **fields: Any) -> dict[str, Any]:
    return {_TAG: kind, **fields}


def encode(value: Any, what: str) -> Any:
    """``value`` as plain values a ``weights_only`` load reads; ``what`` names it in errors."""
    if isinstance(value, _PRIMITIVES):
        return value
    if isinstance(value, (list, tuple)):
        items = [encode(item, what) for item in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise InvalidArgumentError(f"Cannot save {what}: its dict keys must be strings, got {list(value)}.")
        return {k: encode(v, f"{what}[{k!r}]") for k, v in value.items()}
    if isinstance(value, Policy):
        return value.name
    if isinstance(value, optimizers_module.OptimizerSpec):
        return _tagged("optimizer_spec", cls=import_path(value.cls), learning_rate=value.learning_rate,
                       name=value.name, kwargs=encode(value.kwargs, what))
    if isinstance(value, (type, torch.dtype)) or inspect.isroutine(value):
        if isinstance(value, torch.dtype):
            return _tagged("dtype", name=str(value).removeprefix("torch."))
        return _tagged("ref", path=import_path(value, what))
    if isinstance(value, td_metrics.Metric) and _takes_only_a_name(type(value)):
        return _tagged("object", cls=import_path(type(value), what), config={"name": value.name})
    if callable(getattr(value, "get_config", None)):
        return _tagged("object", cls=import_path(_module_class(value), what), config=encode(value.get_config(), what))
    if isinstance(value, torch.nn.Module):
        arguments = getattr(value, "constructor_arguments", None)
        if arguments is None:
            return module_records.encode_module(value, what, encode, lambda cls, where: import_path(cls, where))
        args, kwargs = arguments
        return _tagged("construct", cls=import_path(_module_class(value), what), args=encode(tuple(args), what),
                       kwargs=encode(dict(kwargs), what))
    if type(value) is losses_module.LossFunctionWrapper or (
        isinstance(value, losses_module.LossFunctionWrapper) and type(value).__module__ == losses_module.__name__
    ):
        return _tagged("loss_function", fn=import_path(value.fn, what), name=value.name,
                       kwargs=encode(value.kwargs, what), reduction=value.reduction)
    raise InvalidArgumentError(
        f"Cannot save {what}: a {type(value).__name__} object has no get_config(), so the saved model "
        "could not rebuild it. Pass it by name ('mse', 'accuracy'), as a function defined at the top "
        "level of an importable module, or give its class get_config() returning its constructor's "
        "keyword arguments."
    )


_UNSAFE = Resolver(None, safe_mode=False)
# The entry of each kind of record that names a class or function.
_NAMING_KEY = {"ref": "path", "construct": "cls", "object": "cls", module_records.KIND: "cls",
               "optimizer_spec": "cls", "loss_function": "fn"}


def named_paths(record: Any) -> list[str]:
    """Every class and function path ``record`` (what ``encode`` wrote) names."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            key = _NAMING_KEY.get(str(value.get(_TAG)))
            if key is not None:
                found.append(value[key])
            for item in value.values():
                walk(item)

    walk(record)
    return found


def decode(value: Any, resolver: Resolver = _UNSAFE) -> Any:
    """The inverse of ``encode``: ``resolver`` gives (or refuses) each named class and function."""
    if isinstance(value, list):
        return [decode(item, resolver) for item in value]
    if isinstance(value, tuple):
        return tuple(decode(item, resolver) for item in value)
    if not isinstance(value, dict):
        return value
    kind = value.get(_TAG)
    if kind is None:
        return {k: decode(v, resolver) for k, v in value.items()}
    if kind == "ref":
        return resolver(value["path"])
    if kind == "dtype":
        return getattr(torch, value["name"])
    if kind == "optimizer_spec":
        return optimizers_module.OptimizerSpec(resolver(value["cls"]), value["learning_rate"], value["name"],
                                               **decode(value["kwargs"], resolver))
    if kind == "loss_function":
        return losses_module.LossFunctionWrapper(
            resolver(value["fn"]), name=value["name"], reduction=value.get("reduction", "sum_over_batch_size"),
            **decode(value["kwargs"], resolver))
    if kind == "construct":
        return _class(resolver, value["cls"])(*decode(value["args"], resolver), **decode(value["kwargs"], resolver))
    if kind == module_records.KIND:
        return module_records.decode_module(value, resolver, lambda v: decode(v, resolver))
    if kind == "object":
        cls = _class(resolver, value["cls"])
        config = decode(value["config"], resolver)
        from_config = getattr(cls, "from_config", None)
        return from_config(config) if callable(from_config) else cls(**config)
    raise InvalidArgumentError(f"Unknown entry {kind!r} in a saved model; it was written by a newer torch-distribute.")


def _class(resolver: Resolver, path: str) -> type:
    """The class at ``path``: a saved model calls classes with its arguments, never functions."""
    cls = resolver(path)
    if not isinstance(cls, type):
        raise InvalidArgumentError(f"The saved model names {path} to construct, but it is not a class.")
    return cls


def optimizer_record(optimizer: Any, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> dict[str, Any]:
    """The optimizer's class, hyper-parameters and parameter groups (parameters by name), and
    its loss-scale wrapper's settings: what ``build_optimizer`` needs."""
    scaling = None
    inner = optimizer
    if isinstance(optimizer, LossScaleOptimizer):
        inner = optimizer.inner_optimizer
        scaling = {"dynamic": optimizer.dynamic, "initial_scale": optimizer.initial_scale,
                   "dynamic_growth_steps": optimizer.dynamic_growth_steps}
    names = {id(p): name for name, p in named_parameters}
    groups = []
    for group in inner.param_groups:
        unknown = [p for p in group["params"] if id(p) not in names]
        if unknown:
            raise InvalidArgumentError(
                f"Cannot save the optimizer: it holds {len(unknown)} tensors that are not parameters of the "
                "model. Give the optimizer the model's parameters only."
            )
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({"params": [names[id(p)] for p in group["params"]], **encode(hyper, "the optimizer")})
    return {"cls": import_path(type(inner), f"the optimizer {type(inner).__name__}"),
            "defaults": encode(dict(inner.defaults), "the optimizer"), "groups": groups, "loss_scale": scaling}


def build_optimizer(record: dict[str, Any], named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                    resolver: Resolver = _UNSAFE) -> Any:
    """The optimizer ``optimizer_record`` described, over the parameters of the same names
    (call it in the model's strategy scope)."""
    cls = _class(resolver, record["cls"])
    params = dict(named_parameters)
    missing = [n for group in record["groups"] for n in group["params"] if n not in params]
    if missing:
        raise InvalidArgumentError(f"The saved optimizer holds parameters the model lacks: {missing[:5]}.")
    accepted = inspect.signature(cls).parameters
    defaults = {k: v for k, v in decode(record["defaults"], resolver).items() if k in accepted}
    groups = [{**decode({k: v for k, v in group.items() if k != "params"}, resolver),
               "params": [params[n] for n in group["params"]]} for group in record["groups"]]
    optimizer = cls(groups, **defaults)
    if record["loss_scale"] is not None:
        optimizer = LossScaleOptimizer(optimizer, **record["loss_scale"])
    return optimizer
