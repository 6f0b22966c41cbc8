"""A worker's side: run scheduled functions against the parameter servers.

``run_closure`` (the RPC target the coordinator calls) unpickles the function and its
arguments, resolving every reference to this worker's copy (fetched once from the
coordinator and kept), reads the current values of the variables the function uses from the
servers, calls it, and sends buffer changes back as deltas. ``optimizer.step()`` inside the
function pushes the gradients; the servers apply them with their own optimizer state, so a
worker never waits for another one.
"""

from __future__ import annotations

import inspect
import pickle
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torch_distribute.errors import OutOfRangeError
from torch_distribute.input import InputContext
from torch_distribute.ps import chief, client, hooks, pickling, transport
from torch_distribute.ps.transport import CHIEF
from torch_distribute.ps.variables import VarSpec

_local = threading.local()


def current_worker_index() -> int | None:
    """The index of the worker running the current scheduled function (None elsewhere)."""
    return getattr(_local, "worker_index", None)


class WorkerOptimizer:
    """A worker's stand-in for the coordinator's optimizer: ``step()`` pushes gradients."""

    def __init__(self, runtime: WorkerRuntime, groups: list[list[VarSpec]]):
        self._runtime = runtime
        self.param_groups = [{"params": [runtime.local(spec) for spec in group]} for group in groups]
        self._specs = [spec for group in groups for spec in group]
        self.state: dict[Any, Any] = {}

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [(spec, self._runtime.local(spec).grad) for spec in self._specs]
        pairs = [(s, g) for s, g in grads if g is not None]
        if pairs:
            client.push_gradients([s for s, _ in pairs], [g for _, g in pairs], self._runtime.timeout)
        self._runtime.stale = True
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for spec in self._specs:
            tensor = self._runtime.local(spec)
            if tensor.grad is not None:
                if set_to_none:
                    tensor.grad = None
                else:
                    tensor.grad.zero_()


_strategy_factory: Callable[[int], Any] | None = None


def set_strategy_factory(factory: Callable[[int], Any]) -> None:
    """Called once by the strategies layer: ``factory(worker_index)`` makes the strategy a
    scheduled function sees on this worker (a real ``Strategy``, one local replica)."""
    global _strategy_factory
    _strategy_factory = factory


class WorkerRuntime:
    def __init__(self, worker_index: int, timeout: float):
        self.worker_index = worker_index
        self.timeout = timeout
        self._objects: dict[tuple[str, int], Any] = {}
        self._object_vars: dict[tuple[str, int], list[VarSpec]] = {}
        self._locals: dict[int, torch.Tensor] = {}
        self._used: dict[int, VarSpec] = {}
        self._buffer_snapshots: dict[int, tuple[torch.Tensor, int]] = {}
        self._strategy: Any = None
        self.stale = False
        self._lock = threading.Lock()

    def local(self, spec: VarSpec) -> torch.Tensor:
        tensor = self._locals.get(spec.var_id)
        if tensor is None:
            tensor = self._locals[spec.var_id] = spec.new_local()
        self._used[spec.var_id] = spec
        return tensor

    # -- references ------------------------------------------------------------------------
    def _describe(self, key: tuple[Any, ...]) -> tuple[Any, ...]:
        return transport.call_sync(CHIEF, chief.describe, (key, self.worker_index), timeout=self.timeout)

    def resolve(self, ref: tuple[Any, ...]) -> Any:
        kind = ref[0]
        if kind == "var":
            return self.local(ref[2])
        if kind == "strategy":
            if self._strategy is None:
                if _strategy_factory is None:  # pragma: no cover - import-order bug guard
                    raise RuntimeError("torch_distribute.strategies was not imported")
                self._strategy = _strategy_factory(self.worker_index)
            return self._strategy
        key = (kind, ref[1])
        if key not in self._objects:
            self._objects[key] = self._build(key)
        for spec in self._object_vars.get(key, ()):
            self.local(spec)
        return self._objects[key]

    def _build(self, key: tuple[str, int]) -> Any:
        answer = self._describe(key)
        kind = answer[0]
        if kind == "module":
            specs: list[VarSpec] = []

            def resolve_var(ref: tuple[Any, ...]) -> Any:
                specs.append(ref[2])
                return self.local(ref[2])

            module = pickling.loads(answer[1], resolve_var)
            self._object_vars[key] = specs
            return module
        if kind == "optimizer":
            self._object_vars[key] = [s for group in answer[1] for s in group]
            return WorkerOptimizer(self, answer[1])
        if kind == "value":
            return pickling.loads(answer[1], self.resolve)
        if kind == "dataset":
            source = pickling.loads(answer[1], self.resolve, "the dataset function")
            if callable(source) and not hasattr(source, "__iter__"):
                takes_context = bool(inspect.signature(source).parameters)
                context = InputContext(answer[2], self.worker_index, answer[2])
                source = source(context) if takes_context else source()
            return source
        if kind == "iterator":
            dataset = self.resolve(("per_worker", answer[1]))
            return _Iterator(iter(dataset), self.worker_index)
        raise KeyError(f"unknown description {kind!r}")

    # -- variables ----------------------------------------------------------------------------
    def _flush_buffers(self) -> None:
        specs, deltas = [], []
        for var_id, (snapshot, version) in self._buffer_snapshots.items():
            tensor = self._locals[var_id]
            if tensor._version != version:
                specs.append(self._used[var_id])
                deltas.append(tensor.detach() - snapshot)
        self._buffer_snapshots = {}
        if specs:
            client.push_deltas(specs, deltas, self.timeout)

    def pull(self) -> None:
        self._flush_buffers()
        specs = list(self._used.values())
        if specs:
            client.pull(specs, [self._locals[s.var_id] for s in specs], self.timeout)
        for spec in specs:
            if not spec.is_param:
                tensor = self._locals[spec.var_id]
                self._buffer_snapshots[spec.var_id] = (tensor.detach().clone(), tensor._version)
        self.stale = False

    def refresh(self) -> None:
        if self.stale:
            self.pull()

    # -- running -------------------------------------------------------------------------------
    def run(self, payload: bytes) -> tuple[Any, ...]:
        with self._lock:
            _local.worker_index = self.worker_index
            self._used = {}
            self._buffer_snapshots = {}
            try:
                fn, args, kwargs = pickling.loads(payload, self.resolve, "a scheduled function")
                for tensor in self._locals.values():
                    tensor.grad = None
                self.pull()
                with torch.enable_grad():
                    result = fn(*args, **kwargs)
                self._flush_buffers()
                return ("ok", pickling.dumps_value(pickling.detach_result(result)))
            except BaseException as error:  # noqa: BLE001 - everything goes back to the coordinator
                return _error_reply(error)
            finally:
                _local.worker_index = None


class _Iterator:
    """A per-worker iterator: ``StopIteration`` becomes ``OutOfRangeError`` (TF's behaviour)."""

    def __init__(self, iterator: Iterator[Any], worker_index: int):
        self._iterator = iterator
        self._worker_index = worker_index

    def __iter__(self) -> _Iterator:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._iterator)
        except StopIteration:
            raise OutOfRangeError(
                f"A per-worker iterator ran out of data on worker {self._worker_index}. Give the "
                "dataset function a dataset that repeats (TensorFlow recommends .repeat()) and "
                "schedule a finite number of steps."
            ) from None


def _error_reply(error: BaseException) -> tuple[Any, ...]:
    text = "".join(traceback.format_exception(error))
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, client.ParameterServerCallError):
            return ("ps_error", cause.ps_index, str(cause), text)
        cause = cause.__cause__ or cause.__context__
    try:
        data = pickling.dumps_value(error)
        pickle.loads(data)
    except Exception:
        data = None
    return ("error", data, f"{type(error).__name__}: {error}", text)


_runtime: WorkerRuntime | None = None


def install(runtime: WorkerRuntime) -> None:
    global _runtime
    _runtime = runtime
    hooks.set_refresher(runtime.refresh)


def run_closure(payload: bytes) -> tuple[Any, ...]:
    """RPC target on a worker: run one scheduled function."""
    if _runtime is None:
        return ("error", None, "RuntimeError: this task is not a worker", "")
    return _runtime.run(payload)


transport.entry_points(run_closure)
