"""What a saved model may name: ``load_model``'s ``safe_mode`` and ``custom_objects``.

A saved model names classes and functions by import path (``"package.module:QualName"``).
With ``safe_mode=True`` (the default, as in Keras 3) loading looks each name up, before
anything is imported or built, among:

- ``custom_objects`` given to ``load_model`` (keyed by the qualified name, ``"Net"``, or the
  full path, ``"my_models:Net"``);
- classes and functions decorated with ``register_serializable``;
- ``torch.nn`` and ``torch.optim`` (and ``torch``'s own functions, such as ``torch.relu``),
  from modules ``import torch`` has already loaded;
- ``torch_distribute``'s Keras objects (models, losses, metrics, optimizers).

Anything else is refused, naming it and how to allow it. ``safe_mode=False`` imports what
the file names (trust the file first).

>>> resolver = Resolver(custom_objects=None, safe_mode=True)
>>> resolver("torch.nn.modules.linear:Linear").__name__
'Linear'
>>> resolver("os:system")  # doctest: +IGNORE_EXCEPTION_DETAIL
Traceback (most recent call last):
InvalidArgumentError: ...
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from torch_distribute.errors import InvalidArgumentError

__all__ = ["Resolver", "SAFE_PREFIXES", "object_path", "register_serializable", "registered_objects"]

T = TypeVar("T")

# Module prefixes whose objects a file may name under safe_mode (imported already: nothing is
# imported to look them up).
SAFE_PREFIXES = ("torch.nn.", "torch.optim.", "torch_distribute.keras.", "torch_distribute.metrics.",
                 "torch_distribute.mixed_precision.")
_SAFE_MODULES = ("torch", "torch.nn", "torch.optim", "torch.nn.functional", "torch_distribute.metrics",
                 "torch_distribute.mixed_precision",
                 # torch's compiled operators (F.gelu is torch._C._nn.gelu): functions, never classes
                 "torch._C._nn", "torch._C._VariableFunctions", "torch._C._special", "torch._C._linalg",
                 "torch._C._fft")

_REGISTERED: dict[str, Any] = {}


def object_path(obj: Any) -> str:
    """``"module:qualname"`` of a class or function (no check that importing finds it)."""
    return f"{obj.__module__}:{obj.__qualname__}"


def register_serializable(package: str = "Custom", name: str | None = None) -> Callable[[T], T]:
    """Decorator: ``load_model`` (``safe_mode=True``) may rebuild this class or call this function.

    As Keras' ``register_keras_serializable``: the object is known by its import path and by
    ``"package>name"``. Register it in the saving and in the loading program (a class of
    ``__main__`` too: the loading script defines and registers its own).

    >>> import torch, torch_distribute as td
    >>> @td.keras.saving.register_serializable(package="demo")
    ... class Twice(torch.nn.Module):
    ...     def forward(self, x):
    ...         return 2 * x
    >>> "demo>Twice" in td.keras.saving.registered_objects()
    True
    """
    if not isinstance(package, str) or not package:
        raise InvalidArgumentError(f"register_serializable's package must be a non-empty str, got {package!r}.")

    def decorator(obj: T) -> T:
        if not callable(obj) or not hasattr(obj, "__qualname__"):
            raise InvalidArgumentError(
                f"register_serializable decorates classes and functions, got {type(obj).__name__}.")
        _REGISTERED[object_path(obj)] = obj
        _REGISTERED[f"{package}>{name or obj.__qualname__.rsplit('.', 1)[-1]}"] = obj
        return obj

    return decorator


def registered_objects() -> dict[str, Any]:
    """What ``register_serializable`` registered, by path and by ``"package>name"`` (a copy)."""
    return dict(_REGISTERED)


def _lookup(value: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


class Resolver:
    """``resolver(path)``: the object a saved model names, or ``InvalidArgumentError`` when
    ``safe_mode`` refuses it (``check(paths)`` refuses before anything is built)."""

    def __init__(self, custom_objects: Mapping[str, Any] | None, safe_mode: bool):
        if not isinstance(safe_mode, bool):
            raise InvalidArgumentError(f"safe_mode must be True or False, got {safe_mode!r}.")
        if custom_objects is not None and not (
                isinstance(custom_objects, Mapping) and all(isinstance(k, str) for k in custom_objects)):
            raise InvalidArgumentError(
                "custom_objects must be a dict of names to classes or functions, e.g. {'Net': Net}, "
                f"got {type(custom_objects).__name__}.")
        self.custom_objects = dict(custom_objects or {})
        self.safe_mode = safe_mode

    def _given(self, path: str) -> tuple[bool, Any]:
        module, _, qualname = path.partition(":")
        for key in (path, f"{module}.{qualname}", qualname):
            if key in self.custom_objects:
                return True, self.custom_objects[key]
        for key in (path, qualname):
            if key in _REGISTERED:
                return True, _REGISTERED[key]
        return False, None

    def _safe(self, path: str) -> tuple[bool, Any]:
        module_name, _, qualname = path.partition(":")
        module = sys.modules.get(module_name)
        if module is None or not (module_name in _SAFE_MODULES or module_name.startswith(SAFE_PREFIXES)):
            return False, None
        try:
            return True, _lookup(module, qualname)
        except AttributeError:
            return False, None

    def check(self, paths: Iterable[str]) -> None:
        """Raise ``InvalidArgumentError`` naming every path that ``safe_mode`` refuses."""
        if not self.safe_mode:
            return
        refused = sorted({p for p in paths if not self._given(p)[0] and not self._safe(p)[0]})
        if refused:
            names = ", ".join(refused)
            example = refused[0].partition(":")[2]
            raise InvalidArgumentError(
                f"load_model refused the saved model: it names {names}, which safe_mode=True does not load "
                "(only torch.nn / torch.optim classes, torch functions and torch_distribute.keras objects "
                "load without being allowed, and nothing the file names is imported or run). If you trust "
                f"it, pass custom_objects={{{example!r}: {example.split('.')[-1]}}} to load_model, decorate "
                "the class with @td.keras.saving.register_serializable(), or load with safe_mode=False "
                "(which imports whatever the file names).")

    def __call__(self, path: str) -> Any:
        given, value = self._given(path)
        if given:
            return value
        safe, value = self._safe(path)
        if safe:
            return value
        self.check([path])
        module_name, _, qualname = path.partition(":")
        try:
            return _lookup(importlib.import_module(module_name), qualname)
        except (ImportError, AttributeError) as exc:
            raise InvalidArgumentError(
                f"The saved model names {path}, which this program cannot import ({type(exc).__name__}: "
                f"{exc}): install or define it (a class of the saving script's __main__: define it in "
                f"this script too, or pass custom_objects={{{qualname!r}: ...}}).") from exc
