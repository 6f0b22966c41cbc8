"""``td.function``: TensorFlow's ``@tf.function`` on ``torch.compile``.

Decorate the function that calls ``strategy.run`` (the tutorials' ``distributed_train_step``)
or a replica step. The function that calls ``run`` stays eager Python: it only hands work to
the replicas, and a graph spanning several devices is what CUDA graphs and NCCL capture
cannot take. What ``run`` runs is compiled instead, once per replica and device: each replica
computes with its own copies of the parameters, so dynamo traces one graph per replica (see
``ReplicaTensorMode``), and the gradient sum in ``optimizer.step()`` stays the strategy's own,
exact, outside the graphs. A function that never calls ``run`` is compiled whole.

>>> import torch, torch_distribute as td
>>> strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
>>> with strategy.scope():
...     model = torch.nn.Linear(4, 1)
...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
>>> def train_step(x):
...     loss = td.compute_average_loss(model(x).squeeze(1), global_batch_size=8)
...     loss.backward()
...     optimizer.step()
...     optimizer.zero_grad()
...     return loss
>>> @td.function
... def distributed_train_step(x):
...     return strategy.reduce("sum", strategy.run(train_step, args=(x,)), axis=None)
>>> for x in strategy.experimental_distribute_dataset([torch.ones(8, 4)] * 2):
...     loss = distributed_train_step(x)
>>> distributed_train_step.experimental_get_tracing_count() >= 2  # a graph per replica
True
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from torch_distribute.errors import InvalidArgumentError

__all__ = ["Function", "function", "for_replicas"]

_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


class _Call:
    """One call of a ``Function`` in progress on this thread, and how often it called ``run``."""

    def __init__(self, function: Function):
        self.function = function
        self.runs = 0


class _Active(threading.local):
    def __init__(self) -> None:
        self.calls: list[_Call] = []


_active = _Active()


class Function:
    """A function compiled as ``td.function`` says (see the module docstring).

    ``mode``, ``fullgraph`` and ``dynamic`` are ``torch.compile``'s.
    ``experimental_get_tracing_count()`` is the number of graphs compiled so far, every
    replica's included (TensorFlow counts traces; a graph break makes two graphs).
    """

    def __init__(self, fn: Callable[..., Any], mode: str | None = None, fullgraph: bool = False,
                 dynamic: bool | None = None):
        if not callable(fn):
            raise InvalidArgumentError(f"td.function decorates a callable, got {type(fn).__name__}.")
        if mode not in _MODES:
            raise InvalidArgumentError(f"td.function mode must be one of {list(_MODES)}, got {mode!r}.")
        for name, value in (("fullgraph", fullgraph), ("dynamic", dynamic)):
            if value is not None and not isinstance(value, bool):
                raise InvalidArgumentError(f"td.function {name} must be True, False or None, got {value!r}.")
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._fullgraph = bool(fullgraph)
        self._dynamic = dynamic
        self._inductor = torch._TorchCompileInductorWrapper(mode, None, dynamic)
        self._graphs = 0
        self._lock = threading.Lock()
        self._calls_run: bool | None = None  # learnt on the first call
        self._compiled: weakref.WeakKeyDictionary[Any, Callable[..., Any]] = weakref.WeakKeyDictionary()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._calls_run is False:
            return self.compiled(self._fn)(*args, **kwargs)
        call = _Call(self)
        _active.calls.append(call)
        try:
            result = self._fn(*args, **kwargs)
        finally:
            _active.calls.pop()
        if self._calls_run is None:
            self._calls_run = call.runs > 0
        return result

    def _backend(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        with self._lock:
            self._graphs += 1
        return self._inductor(graph, example_inputs)

    def compiled(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` compiled with this function's options (once per function object)."""
        target, owner = (fn.__func__, fn.__self__) if hasattr(fn, "__func__") else (fn, None)
        with self._lock:
            compiled = self._compiled.get(target)
            if compiled is None:
                compiled = torch.compile(target, backend=self._backend, fullgraph=self._fullgraph,
                                         dynamic=self._dynamic)
                self._compiled[target] = compiled
        return compiled if owner is None else functools.partial(compiled, owner)

    def experimental_get_tracing_count(self) -> int:
        """The number of graphs compiled so far."""
        return self._graphs


def function(fn: Callable[..., Any] | None = None, *, mode: str | None = None, fullgraph: bool = False,
             dynamic: bool | None = None) -> Any:
    """``@td.function`` or ``td.function(fn, mode=..., fullgraph=..., dynamic=...)``."""
    if fn is None:
        return lambda f: Function(f, mode=mode, fullgraph=fullgraph, dynamic=dynamic)
    return Function(fn, mode=mode, fullgraph=fullgraph, dynamic=dynamic)


def for_replicas(fn: Callable[..., Any]) -> Callable[..., Any]:
    """What ``strategy.run`` should run for ``fn``: compiled inside a ``td.function`` call."""
    if not _active.calls:
        return fn
    call = _active.calls[-1]
    call.runs += 1
    return call.function.compiled(fn)
