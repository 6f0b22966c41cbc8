"""The hook every module made in ``ParameterServerStrategy.scope()`` carries.

It runs before ``forward`` and before ``state_dict``: on the coordinator it writes changes
made locally (``load_state_dict``, in-place edits) to the parameter servers and then reads
their current values when training may have changed them; on a worker it re-reads the
values after an optimizer step of the same scheduled function. A module shipped to a worker
pickles the hook as is (it holds no state); what it does depends on the process it runs in.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

_refresher: Callable[[], None] | None = None


def set_refresher(refresher: Callable[[], None] | None) -> None:
    """Install this process's refresh function (the coordinator's or the worker's)."""
    global _refresher
    _refresher = refresher


class RefreshHook:
    """``forward`` pre-hook and ``state_dict`` pre-hook: bring local values up to date."""

    def __call__(self, *args: Any) -> None:
        if _refresher is not None:
            _refresher()

    def __reduce__(self) -> tuple[Any, tuple]:
        return (RefreshHook, ())


_hooked: weakref.WeakSet[Any] = weakref.WeakSet()


def attach(module: Any) -> None:
    """Add the hooks once to ``module``."""
    if module in _hooked:
        return
    hook = RefreshHook()
    module.register_forward_pre_hook(hook)
    module.register_state_dict_pre_hook(hook)
    _hooked.add(module)
