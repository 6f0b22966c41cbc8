"""The networks made in a strategy's scope: its top-level modules that hold trainable parameters.

A GAN's scope makes several (generators, discriminators), a classifier's one. ``td.function``
compiles each network's forward as a graph of its own when a step's strategy has several
(``compiled_function``), so that each network gets its own backward and a ``backward`` that
reaches only some of them runs only theirs. ``interception.py`` records here every parameter
and submodule its hooks see in a scope; a network is a module that holds (itself or below
it) a trainable parameter registered in the scope and was never registered on another
module there. A top-level container without a ``forward`` of its own (``nn.ModuleDict``,
``nn.ModuleList``, a class holding networks) stands for its children.

>>> import torch, torch_distribute as td
>>> strategy = td.OneDeviceStrategy("cpu")
>>> with strategy.scope():
...     generator = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Linear(4, 2))
...     discriminator = torch.nn.Linear(2, 1)
...     frozen = torch.nn.Linear(2, 2).requires_grad_(False)
>>> [net is generator or net is discriminator for net in of(strategy).networks()]
[True, True]
"""

from __future__ import annotations

import threading
import weakref

from torch import nn

__all__ = ["ScopeNetworks", "of"]


class ScopeNetworks:
    """The modules of one strategy's scope: which hold parameters, which are someone's child."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Insertion-ordered (dicts of weak keys): the networks in the order they were made.
        self._modules: weakref.WeakKeyDictionary[nn.Module, None] = weakref.WeakKeyDictionary()
        self._children: weakref.WeakKeyDictionary[nn.Module, None] = weakref.WeakKeyDictionary()

    def parameter_registered(self, module: nn.Module) -> None:
        """A parameter was registered on ``module`` in the scope."""
        with self._lock:
            self._modules[module] = None

    def submodule_registered(self, parent: nn.Module, child: nn.Module) -> None:
        """``child`` was registered on ``parent`` in the scope."""
        with self._lock:
            self._modules[parent] = None
            self._modules[child] = None
            self._children[child] = None

    def networks(self) -> list[nn.Module]:
        """The top-level modules with a trainable parameter, containers replaced by their children."""
        with self._lock:
            roots = [m for m in self._modules.keys() if m not in self._children]
        found: list[nn.Module] = []
        for root in roots:
            _collect(root, found)
        return found


def _collect(module: nn.Module, found: list[nn.Module]) -> None:
    if not any(p.requires_grad for p in module.parameters()):
        return
    if type(module).forward is nn.Module.forward:  # a container without a forward of its own
        for child in module.children():
            _collect(child, found)
    elif not any(known is module for known in found):
        found.append(module)


_by_strategy: weakref.WeakKeyDictionary[object, ScopeNetworks] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def of(strategy: object) -> ScopeNetworks:
    """``strategy``'s record (made on first use)."""
    with _registry_lock:
        found = _by_strategy.get(strategy)
        if found is None:
            found = _by_strategy[strategy] = ScopeNetworks()
        return found
