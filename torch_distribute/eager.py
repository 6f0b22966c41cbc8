"""``never_compiled``: ``torch.compiler.disable`` without importing ``torch._dynamo`` up front.

Applying ``torch.compiler.disable`` imports dynamo, about 1.7 s of CPU: every worker of a job
and every process that only imports this package would pay it. ``never_compiled(fn)`` defers
that. While no module of the process has imported dynamo, nothing can be compiling, so the
wrapper calls ``fn`` directly; once dynamo is loaded it calls ``torch.compiler.disable(fn)``,
made on first use.

Dynamo never traces the wrapper: it carries the mark dynamo gives disabled functions (so a
compiled caller breaks its graph before the call instead of inlining it), and the wrapper's
code is registered as skipped before dynamo can meet it (so the eager call after that break
is not compiled either, exactly as with ``torch.compiler.disable``). Importing this module
changes nothing: ``watch_for_compiler`` registers it, at once if dynamo is loaded, else the
moment dynamo is imported; the first strategy, ``td.function`` and the first call of a
wrapper call it (``strategies/torch_patches.py`` lists it).

Example::

    >>> class Step:
    ...     @never_compiled
    ...     def run(self, x):
    ...         return x + 1
    >>> Step().run(1)
    2
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

_DYNAMO = "torch._dynamo"
_wrapper_code_skipped = False
_watch_lock = threading.Lock()
_watcher: _WhenDynamoIsImported | None = None


def never_compiled(fn: F) -> F:
    """``fn``, never traced by ``torch.compile``; dynamo is imported only by whoever compiles."""
    disabled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if _DYNAMO not in sys.modules:
            if _watcher is None:
                watch_for_compiler()
            return fn(*args, **kwargs)
        if disabled is None:
            watch_for_compiler()
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    call._torchdynamo_disable = True  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]


def _skip_wrapper_code() -> None:
    """Tell dynamo never to compile a frame of the wrapper (one code object serves every
    wrapper ``never_compiled`` makes)."""
    global _wrapper_code_skipped
    if _wrapper_code_skipped:
        return
    _wrapper_code_skipped = True
    # torch keeps this in dynamo's decorators (``skip``: the frame runs eagerly, what it calls
    # is still compiled); without it the wrapper is traced once, and graph-breaks at ``fn``.
    decorators = sys.modules.get(f"{_DYNAMO}.decorators")
    skip = getattr(decorators, "skip", None)
    if skip is not None:
        skip(never_compiled(_skip_wrapper_code))


class _WhenDynamoIsImported(importlib.abc.MetaPathFinder):
    """Runs ``_skip_wrapper_code`` right after ``torch._dynamo`` is executed, before anything
    can be traced (Python has no post-import hook; this finder wraps the module's loader)."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if name != _DYNAMO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_skip(module: ModuleType) -> None:
            exec_module(module)
            _skip_wrapper_code()

        loader.exec_module = exec_then_skip  # type: ignore[union-attr]  # this spec's own loader
        return spec


def watch_for_compiler() -> None:
    """Make sure dynamo never compiles a frame of a ``never_compiled`` wrapper: tell it now if
    ``torch._dynamo`` is loaded, else right after it is imported (a finder on ``sys.meta_path``,
    which takes itself out then). Idempotent, thread-safe."""
    global _watcher
    with _watch_lock:
        if _DYNAMO in sys.modules:
            _skip_wrapper_code()
        elif _watcher is None:
            _watcher = _WhenDynamoIsImported()
            sys.meta_path.insert(0, _watcher)
