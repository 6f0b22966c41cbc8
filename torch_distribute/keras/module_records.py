"""Any ``nn.Module`` as plain values: its class, attributes, submodules and parameter shapes.

What ``Model.save`` records for a module that has neither recorded constructor arguments
(a ``td.keras.Model`` subclass) nor ``get_config()``: ``nn.Sequential``, ``ModuleList``,
``ModuleDict``, every ``torch.nn`` layer and the user's own modules. It is what pickling
keeps (the class and the ``__getstate__`` dictionary), written as data that a
``weights_only`` load reads: the class by import path, each attribute as a plain value
(numbers, strings, tuples, dtypes, functions by import path), each submodule as such a
record, each parameter as its shape and dtype (the values are the saved ``state_dict``'s),
each buffer with its value. A tensor held twice (tied weights) or a module used twice is
recorded once and referred to by its path.

Rebuilding calls no constructor: ``cls.__new__(cls)`` then ``__setstate__`` with the decoded
dictionary, as unpickling does, but only for classes the loader allows (see ``allowlist``).

>>> import torch
>>> from torch_distribute.keras.allowlist import Resolver, object_path
>>> keep = lambda value, what=None: value
>>> record = encode_module(torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU()), "the model",
...                        keep, lambda cls, what: object_path(cls))
>>> record["cls"]
'torch.nn.modules.container:Sequential'
>>> rebuilt = decode_module(record, Resolver(None, safe_mode=True), keep)
>>> [type(m).__name__ for m in rebuilt], rebuilt[0].weight.shape
(['Linear', 'ReLU'], torch.Size([3, 2]))
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torch_distribute.errors import InvalidArgumentError

__all__ = ["KIND", "decode_module", "encode_module", "module_class"]

KIND = "module"
_TAG = "__td_keras__"
# Where torch's composable APIs (fully_shard) keep their state on a module: made again when sharded again.
_COMPOSABLE_STATE = "__composable_api_state_key"
_STRUCTURE = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")

Encode = Callable[[Any, str], Any]
PathOf = Callable[[type, str], str]
Decode = Callable[[Any], Any]
Resolve = Callable[[str], Any]


def module_class(module: nn.Module) -> type:
    """The class the user made ``module`` of: ``fully_shard`` swaps in a generated subclass."""
    cls = type(module)
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing was sharded
    if fsdp is not None and isinstance(module, fsdp.FSDPModule):
        cls = next(base for base in cls.__bases__ if base is not fsdp.FSDPModule)
    return cls


def _is_hook_entry(name: str) -> bool:
    return "hooks" in name or name == "_is_full_backward_hook"


class _Encoder:
    """One module tree's record; ``seen`` maps tensors and modules already written to their path."""

    def __init__(self, encode: Encode, path_of: PathOf, what: str):
        self.encode = encode
        self.path_of = path_of
        self.what = what
        self.seen: dict[int, tuple[str, Any]] = {}

    def module(self, module: nn.Module, path: str) -> dict[str, Any]:
        if id(module) in self.seen:
            return {_TAG: "module_ref", "path": self.seen[id(module)][0]}
        self.seen[id(module)] = (path, module)
        cls = module_class(module)
        where = f"{self.what} ({path or 'the root module'}, a {cls.__qualname__})"
        sharded = cls is not type(module)
        state = module.__getstate__()
        # A strategy's own hooks (and fully_shard's) are made again when the model is captured again.
        hooks = [name for name, value in state.items() if _is_hook_entry(name) and isinstance(value, dict)
                 and any(not _installed_by_a_strategy(hook) for hook in value.values())]
        if hooks and not sharded:
            raise InvalidArgumentError(
                f"Cannot save {where}: it has hooks ({', '.join(hooks)}), which a saved model does not keep. "
                "Remove them before saving (handle.remove()) and register them again after loading, or give "
                "the class get_config() so that its constructor registers them.")
        # The registries as pickling sees them (a None entry included).
        parameters = {name: self.parameter(param, _join(path, name)) for name, param in state["_parameters"].items()}
        buffers = {name: self.buffer(buffer, _join(path, name)) for name, buffer in state["_buffers"].items()}
        children = {name: None if child is None else self.module(child, _join(path, name))
                    for name, child in state["_modules"].items()}
        attributes = {}
        for name, value in state.items():
            if name in _STRUCTURE or _is_hook_entry(name) or (sharded and name.startswith(_COMPOSABLE_STATE)):
                continue
            attributes[name] = self.value(value, f"{where}.{name}")
        return {_TAG: KIND, "cls": self.path_of(cls, where), "parameters": parameters, "buffers": buffers,
                "non_persistent": sorted(state["_non_persistent_buffers_set"]), "children": children,
                "attributes": attributes}

    def parameter(self, param: Any, path: str) -> Any:
        if param is None:
            return None
        if id(param) in self.seen:
            return {_TAG: "tensor_ref", "path": self.seen[id(param)][0]}
        self.seen[id(param)] = (path, param)
        return {"shape": list(param.shape), "dtype": self.encode(param.dtype, path),
                "requires_grad": bool(param.requires_grad)}

    def buffer(self, buffer: Any, path: str) -> Any:
        if buffer is None:
            return None
        if id(buffer) in self.seen:
            return {_TAG: "tensor_ref", "path": self.seen[id(buffer)][0]}
        self.seen[id(buffer)] = (path, buffer)
        full = getattr(buffer, "full_tensor", None)
        return {"value": (full() if callable(full) else buffer).detach().cpu().clone()}

    def value(self, value: Any, what: str) -> Any:
        if isinstance(value, torch.Tensor) and id(value) in self.seen:
            return {_TAG: "tensor_ref", "path": self.seen[id(value)][0]}
        if isinstance(value, nn.Module):
            raise InvalidArgumentError(
                f"Cannot save {what}: a module held as a plain attribute, not registered as a submodule.")
        if isinstance(value, torch.Size):
            return {_TAG: "size", "dims": list(value)}
        if isinstance(value, (set, frozenset)):
            return {_TAG: "set", "items": [self.value(v, what) for v in sorted(value, key=repr)]}
        if isinstance(value, (list, tuple)):
            items = [self.value(item, what) for item in value]
            return items if isinstance(value, list) else tuple(items)
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return {k: self.value(v, f"{what}[{k!r}]") for k, v in value.items()}
        if isinstance(value, torch.device):
            return {_TAG: "device", "name": str(value)}
        return self.encode(value, what)


def _installed_by_a_strategy(hook: Any) -> bool:
    """Whether ``hook`` is torch-distribute's or torch.distributed's (not the user's)."""
    hook = getattr(hook, "func", hook)  # functools.partial
    hook = getattr(hook, "__func__", hook)  # a bound method
    module = getattr(hook, "__module__", None) or type(hook).__module__
    return module.startswith(("torch_distribute.", "torch.distributed."))


def _empty_hooks() -> dict[str, Any]:
    """The hook entries of a new module (a record keeps none)."""
    blank = nn.Module()
    return {name: type(value)() if value is not None else None
            for name, value in blank.__dict__.items() if _is_hook_entry(name)}


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def encode_module(module: nn.Module, what: str, encode: Encode, path_of: PathOf) -> dict[str, Any]:
    """``module``'s record; ``encode(value, what)`` writes attribute values (functions, dtypes),
    ``path_of(cls, what)`` names each class.

    Raises ``InvalidArgumentError`` naming an attribute that cannot be written as a value,
    or hooks (which a record does not keep).
    """
    return _Encoder(encode, path_of, what).module(module, "")


class _Decoder:
    def __init__(self, resolve: Resolve, decode: Decode):
        self.resolve = resolve
        self.decode = decode
        self.built: dict[str, Any] = {}

    def ref(self, path: str) -> Any:
        if path not in self.built:
            raise InvalidArgumentError(f"The saved model refers to {path!r} before recording it; the file is damaged.")
        return self.built[path]

    def module(self, record: dict[str, Any], path: str) -> nn.Module:
        if record.get(_TAG) == "module_ref":
            return self.ref(record["path"])
        cls = self.resolve(record["cls"])
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise InvalidArgumentError(f"The saved model names {record['cls']} as a module, but it is not an nn.Module.")
        module = cls.__new__(cls)
        self.built[path] = module
        parameters: OrderedDict[str, Any] = OrderedDict()
        for name, spec in record["parameters"].items():
            parameters[name] = self.parameter(spec, _join(path, name))
        buffers: OrderedDict[str, Any] = OrderedDict()
        for name, spec in record["buffers"].items():
            buffers[name] = self.tensor(spec, _join(path, name), lambda s: s["value"])
        children: OrderedDict[str, Any] = OrderedDict(
            (name, None if child is None else self.module(child, _join(path, name)))
            for name, child in record["children"].items())
        state = _empty_hooks()
        state.update({name: self.value(value) for name, value in record["attributes"].items()})
        state.update(_parameters=parameters, _buffers=buffers, _modules=children,
                     _non_persistent_buffers_set=set(record["non_persistent"]))
        module.__setstate__(state)
        return module

    def parameter(self, spec: Any, path: str) -> Any:
        def make(s: dict[str, Any]) -> nn.Parameter:
            return nn.Parameter(torch.empty(s["shape"], dtype=self.decode(s["dtype"])),
                                requires_grad=s["requires_grad"])

        return self.tensor(spec, path, make)

    def tensor(self, spec: Any, path: str, make: Callable[[dict[str, Any]], Any]) -> Any:
        if spec is None:
            return None
        if spec.get(_TAG) == "tensor_ref":
            return self.ref(spec["path"])
        self.built[path] = tensor = make(spec)
        return tensor

    def value(self, value: Any) -> Any:
        if isinstance(value, list):
            return [self.value(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.value(v) for v in value)
        if isinstance(value, dict):
            kind = value.get(_TAG)
            if kind == "tensor_ref":
                return self.ref(value["path"])
            if kind == "size":
                return torch.Size(value["dims"])
            if kind == "set":
                return {self.value(v) for v in value["items"]}
            if kind == "device":
                return torch.device(value["name"])
            if kind is None:
                return {k: self.value(v) for k, v in value.items()}
        return self.decode(value)


def decode_module(record: dict[str, Any], resolve: Resolve, decode: Decode) -> nn.Module:
    """The module ``encode_module`` recorded, its parameters uninitialized (load the
    ``state_dict`` next); ``resolve(path)`` gives each class (and refuses what is not allowed),
    ``decode`` reads attribute values."""
    return _Decoder(resolve, decode).module(record, "")
