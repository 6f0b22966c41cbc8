"""``td.function``: TensorFlow's ``@tf.function`` on ``torch.compile``.

Decorate the function that calls ``strategy.run`` (the tutorials' ``distributed_train_step``)
or a replica step. The function that calls ``run`` stays eager Python: it only hands work to
the replicas, and a graph spanning several devices is what CUDA graphs and NCCL capture
cannot take. What ``run`` runs is compiled instead, and the gradient sum in
``optimizer.step()`` stays the strategy's own, exact, outside the graphs. A function that
never calls ``run`` is compiled whole.

Each replica computes with its own copies of the parameters (``ReplicaTensorMode``), which
the graph takes as inputs, so replicas that share a device (CPU replicas, logical GPUs of one
card) share one graph: dynamo traces it once. For that the replicas take turns in a ``run``
whose inputs differ in kind (shapes, dtypes, devices, Python values) from the last run's: each
runs until it merges or returns, then the next, so every replica but the first finds the graph
replica 0 traced or picked at the front of dynamo's cache. Run together, they would each miss
it and trace their own (and two threads looking up a graph that is not the front entry can miss
it: dynamo moves the entry it finds to the front). A step fed more than 16 kinds of input
(shapes that vary) runs its replicas together: by then dynamo has made its graph dynamic.
Replicas on different devices get a graph each.

Where the step's strategy made several networks in its scope (a GAN's generators and
discriminators: ``strategies/networks.py``), each network's forward is compiled as a graph of
its own, and the replica step's graph breaks around each network call (the losses and the
optimizer steps are the graphs between). One graph for the whole forward would give torch's
autograd one backward node for every network: each ``backward(inputs=...)`` of a GAN step
would run all of it (the CycleGAN step: 208 convolution backward kernels a step against
eager's 72 at a small size), and a backward that frees it (the DCGAN step's discriminator
loss) would leave nothing for the generator's. So each network call gets its backward node,
and a backward runs those it reaches, as in eager. While a call lasts, each network's
``forward`` is an instance attribute that runs the network's compiled graph when called from
this function's compiled replica step, and the module's own forward elsewhere (the code of
the decorated function itself, another thread); the call gives the module its forward back
when it returns. ``split_networks=False`` keeps one graph per replica step, ``True`` splits
at a single network too (its forward apart from the loss, as ``torch.compile(model)``).

On CUDA, ``mode=None`` picks CUDA graphs (``"reduce-overhead"``) where each process drives
one GPU replica (``OneDeviceStrategy``, one GPU per worker under torchrun), and plain
compiled kernels with one warning saying why where replicas share the process (CUDA graphs
capture per process, and replica threads would capture concurrently); asking for them there
(``mode="reduce-overhead"`` or ``"max-autotune"``) is an error. When torch's inductor
cannot use CUDA graphs for a part of the step, one warning gives its reason.

Several CPU replicas in one process (``MirroredStrategy(["cpu:0", "cpu:1"])``) run their
compiled steps in threads. Inductor's default Python wrapper calls each generated C++ kernel
holding the GIL, so the threads would take turns; for them the graphs are built with
inductor's C++ wrapper (``cpp_wrapper``), which runs a whole graph in C++ with the GIL
released, and the replicas' graphs overlap.

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
>>> distributed_train_step.experimental_get_tracing_count()  # one graph for both replicas
1
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from torch_distribute import config, nest
from torch_distribute.compile_once import compile_with_inductor
from torch_distribute.eager import never_compiled, watch_for_compiler
from torch_distribute.errors import InputSignatureError, InvalidArgumentError
from torch_distribute.input.element_spec import TensorSpec
from torch_distribute.values import DistributedValues

__all__ = ["Function", "ReplicaStep", "function", "for_replicas"]

_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


class _Call:
    """One call of a ``Function`` in progress on this thread, how often it called ``run``, and
    the networks whose forward is a graph of its own until it returns."""

    def __init__(self, function: Function):
        self.function = function
        self.runs = 0
        self.networks = _NetworkForwards()


class _Active(threading.local):
    def __init__(self) -> None:
        self.calls: list[_Call] = []


_active = _Active()


class _Compiling(threading.local):
    def __init__(self) -> None:
        self.function: Function | None = None


_compiling = _Compiling()


class _CudagraphSkips(logging.Handler):
    """Hands inductor's "skipping cudagraphs due to ..." to the ``Function`` being compiled
    or run on this thread (the message is logged whether or not torch logging shows it)."""

    def emit(self, record: logging.LogRecord) -> None:
        function = _compiling.function
        if function is not None:
            function.report_cudagraph_skip(record.getMessage())


# torch logs these on an artifact logger; a handler of our own sees them without TORCH_LOGS.
_CUDAGRAPH_LOGGER = "torch._inductor.cudagraph_utils.__cudagraphs"
_cudagraph_skips = _CudagraphSkips()
# Graphs dynamo keeps per code object before it gives up and runs it eagerly: replicas on
# different devices need their own (and one more for a ragged last batch), so the limit grows
# with the replicas.
_GRAPHS_PER_REPLICA = 8
# Kinds of input for which a compiled replica step's replicas take turns (see the docstring).
_KINDS_WITH_TURNS = 16


class _NetworkForwards:
    """The networks whose ``forward`` this call replaced with ``network_forward``'s, and
    what each had in its instance dict before (``_MISSING``: nothing, the class's)."""

    def __init__(self) -> None:
        self._replaced: list[tuple[torch.nn.Module, Any]] = []

    def replace(self, module: torch.nn.Module, forward: Callable[..., Any]) -> None:
        if any(known is module for known, _ in self._replaced):
            return
        self._replaced.append((module, module.__dict__.get("forward", _MISSING)))
        module.__dict__["forward"] = forward  # not Module.__setattr__: a plain instance attribute

    def restore(self) -> None:
        while self._replaced:
            module, before = self._replaced.pop()
            if before is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = before


_MISSING = object()
# Set on a forward made by ``_network_forward``: the forward it stands in for.
_STANDS_FOR = "_td_function_stands_for"


class _InputKinds:
    """The kinds of input (``_input_kind``) a compiled replica step has run with."""

    def __init__(self) -> None:
        self.seen: set[tuple[Any, ...]] = set()  # at most _KINDS_WITH_TURNS
        self.last: tuple[Any, ...] | None = None


class _ProcessSettings:
    """What ``td.function`` changes outside itself (``strategies/torch_patches.py`` lists it):
    the handler on inductor's CUDA-graph logger, added when the first ``Function`` compiles,
    and dynamo's recompile limit, raised for several replicas (``allow_graphs_for``). Both are
    put back when the last ``Function`` that compiled is gone: the limit only if nobody changed
    it since."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._functions: weakref.WeakSet[Function] = weakref.WeakSet()  # those that compiled
        # One per function that compiled, alive while it lives (a WeakSet still counts an
        # object while its finalizers run).
        self._finalizers: list[weakref.finalize[Any, Any]] = []
        self._limit: tuple[str, int, int] | None = None  # (dynamo's name, before, ours)

    def compiling(self, function: Function) -> None:
        with self._lock:
            if function in self._functions:
                return
            logging.getLogger(_CUDAGRAPH_LOGGER).addHandler(_cudagraph_skips)  # once: a no-op if there
            self._functions.add(function)
            finalizer = weakref.finalize(function, self._function_gone)
            finalizer.atexit = False  # nothing to undo at exit
            self._finalizers[:] = [f for f in self._finalizers if f.alive] + [finalizer]

    def allow_graphs_for(self, replicas: int) -> None:
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        wanted = _GRAPHS_PER_REPLICA * replicas
        with self._lock:
            current = getattr(config, name)
            if current < wanted:
                setattr(config, name, wanted)
                before = current if self._limit is None else self._limit[1]
                self._limit = (name, before, wanted)

    def _function_gone(self) -> None:
        # A finalizer: any thread, any time. Give up rather than wait for the lock.
        if not self._lock.acquire(blocking=False):
            return
        try:
            if any(f.alive for f in self._finalizers):
                return
            self._finalizers.clear()
            logging.getLogger(_CUDAGRAPH_LOGGER).removeHandler(_cudagraph_skips)
            if self._limit is not None:
                name, before, ours = self._limit
                config = torch._dynamo.config
                if getattr(config, name) == ours:
                    setattr(config, name, before)
                self._limit = None
        finally:
            self._lock.release()


_settings = _ProcessSettings()


class Function:
    """A function compiled as ``td.function`` says (see the module docstring).

    ``mode``, ``fullgraph`` and ``dynamic`` are ``torch.compile``'s. ``input_signature``: as
    TensorFlow's, a list of ``td.TensorSpec`` (or nests of them), one per positional argument:
    every call is checked against it (``InvalidArgumentError`` for a tensor that does not
    match), and each ``None`` dimension is marked dynamic before the first compile, so other
    sizes there (a ragged last batch) compile no new graph. ``split_networks``: ``None``
    compiles each network of a strategy's scope as a graph of its own where the scope made
    several, ``True`` also where it made one, ``False`` never (see the module docstring).
    ``experimental_get_tracing_count()`` is the number of graphs compiled so far, every
    replica's and every network's included (TensorFlow counts traces; a graph break makes
    two graphs, and a step split at its networks has one per network and more between them).
    """

    __name__: str  # with the rest of ``fn``'s metadata, from functools.update_wrapper

    def __init__(self, fn: Callable[..., Any], mode: str | None = None, fullgraph: bool = False,
                 dynamic: bool | None = None, input_signature: Sequence[Any] | None = None,
                 split_networks: bool | None = None):
        if not callable(fn):
            raise InvalidArgumentError(f"td.function decorates a callable, got {type(fn).__name__}.")
        if mode not in _MODES:
            raise InvalidArgumentError(f"td.function mode must be one of {list(_MODES)}, got {mode!r}.")
        for name, value in (("fullgraph", fullgraph), ("dynamic", dynamic), ("split_networks", split_networks)):
            if value is not None and not isinstance(value, bool):
                raise InvalidArgumentError(f"td.function {name} must be True, False or None, got {value!r}.")
        if fullgraph and split_networks:
            raise InvalidArgumentError(
                "td.function: fullgraph=True asks for one graph per replica step, split_networks=True for "
                "a graph per network: pass one of them.")
        if input_signature is not None:
            specs = nest.leaves(list(input_signature)) if isinstance(input_signature, (list, tuple)) else None
            if not specs or not all(isinstance(spec, TensorSpec) for spec in specs):
                raise InvalidArgumentError(
                    "td.function input_signature must be a list of td.TensorSpec (or nests of them), one per "
                    f"positional argument, e.g. [td.TensorSpec((None, 4), torch.float32)]; got {input_signature!r}.")
        self.input_signature = None if input_signature is None else list(input_signature)
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._mode = mode
        self._fullgraph = bool(fullgraph)
        self._dynamic = dynamic
        self._split_networks = split_networks
        self._inductors: dict[tuple[str | None, bool], Any] = {}
        self._graphs: list[None] = []  # one entry per graph compiled (appending is atomic)
        self._lock = threading.RLock()
        self._calls_run: bool | None = None  # learnt on the first call
        self._compiled: weakref.WeakKeyDictionary[Any, dict[tuple[str | None, bool], Callable[..., Any]]] = (
            weakref.WeakKeyDictionary()
        )
        self._input_kinds: weakref.WeakKeyDictionary[Any, _InputKinds] = weakref.WeakKeyDictionary()
        self._network_forwards: weakref.WeakKeyDictionary[
            torch.nn.Module, dict[tuple[str | None, bool], Callable[..., Any]]] = weakref.WeakKeyDictionary()
        self._warned: set[str] = set()

    def _check_signature(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Check ``args`` against ``input_signature`` and mark its ``None`` dimensions dynamic."""
        signature = self.input_signature or []
        if kwargs or len(args) != len(signature):
            raise InputSignatureError(
                f"td.function({self.__name__}) has an input_signature of {len(signature)} positional arguments; "
                f"it was called with {len(args)} positional and {len(kwargs)} keyword arguments.")
        for position, (spec, value) in enumerate(zip(signature, args, strict=True)):
            spec_leaves, spec_structure = nest.flatten(spec)
            value_leaves, value_structure = nest.flatten(value)
            if spec_structure != value_structure:
                raise InputSignatureError(
                    f"td.function({self.__name__}): argument {position} is "
                    f"{nest.map_structure(lambda _: '*', value)!r} (* a leaf) but its input_signature is "
                    f"{nest.map_structure(lambda _: '*', spec)!r}: give the arguments the signature's structure.")
            for leaf_spec, leaf in zip(spec_leaves, value_leaves, strict=True):
                for tensor in leaf.values if isinstance(leaf, DistributedValues) else (leaf,):
                    if not isinstance(tensor, torch.Tensor) or not leaf_spec.is_compatible_with(tensor):
                        shown = (f"a tensor of shape {tuple(tensor.shape)} and dtype {tensor.dtype}"
                                 if isinstance(tensor, torch.Tensor) else f"a {type(tensor).__name__}")
                        raise InputSignatureError(
                            f"td.function({self.__name__}): argument {position} does not match its input_signature "
                            f"{leaf_spec}: got {shown}.")
                    for dim, size in enumerate(leaf_spec.shape):
                        if size is None:
                            torch._dynamo.maybe_mark_dynamic(tensor, dim)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.input_signature is not None:
            self._check_signature(args, kwargs)
        if config.functions_run_eagerly():  # td.config.run_functions_eagerly(True): debugging
            return self._fn(*args, **kwargs)
        if self._calls_run is False:
            return self.compiled(self._fn)(*args, **kwargs)
        call = _Call(self)
        _active.calls.append(call)
        try:
            result = self._fn(*args, **kwargs)
        finally:
            _active.calls.pop()
            call.networks.restore()
        if self._calls_run is None:
            self._calls_run = call.runs > 0
        return result

    def _backend(self, mode: str | None, cpp_wrapper: bool) -> Callable[..., Any]:
        with self._lock:
            inductor = self._inductors.get((mode, cpp_wrapper))
            if inductor is None:
                options = {"cpp_wrapper": True} if cpp_wrapper else None
                inductor = self._inductors[mode, cpp_wrapper] = torch._TorchCompileInductorWrapper(
                    mode, options, self._compile_dynamic())

        graphs = self._graphs  # not self: dynamo's cache keeps the backend as long as the code

        def count_and_compile(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            graphs.append(None)
            return compile_with_inductor(inductor, graph, example_inputs)  # once per host

        return count_and_compile

    def _mode_for(self, devices: tuple[torch.device, ...] | None) -> str | None:
        """The mode asked for, else CUDA graphs for one GPU replica per process (see above)."""
        if not devices or not any(d.type == "cuda" for d in devices):
            return self._mode
        if self._mode in _CUDA_GRAPH_MODES and len(devices) > 1:
            raise InvalidArgumentError(
                f"td.function({self.__name__}): mode={self._mode!r} captures CUDA graphs, and torch keeps "
                f"those per thread, while this strategy runs its {len(devices)} replicas in threads of "
                "one process. Leave mode out (or use 'default' or 'max-autotune-no-cudagraphs') to run "
                "the replicas as compiled kernels, or run one process per GPU "
                "(MultiWorkerMirroredStrategy under torchrun) for CUDA graphs.")
        if self._mode is not None:
            return self._mode
        if len(devices) == 1:
            return "reduce-overhead"
        self._warn_once(
            "threads",
            f"td.function({self.__name__}): CUDA graphs are not used: its {len(devices)} replicas run "
            "in threads of one process, and CUDA graphs capture per process. The replica steps run "
            "as compiled kernels. For CUDA graphs, run one process per GPU "
            "(MultiWorkerMirroredStrategy under torchrun).",
        )
        return None

    def _warn_once(self, key: str, message: str) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        warnings.warn(message, stacklevel=4)

    def report_cudagraph_skip(self, reason: str) -> None:
        """Warn (once per function) that inductor skipped CUDA graphs for ``reason``."""
        self._warn_once(
            "cudagraph skip",
            f"td.function({self.__name__}): CUDA graphs are not used for part of the step, which "
            f"runs as compiled kernels instead; torch says: {reason}. Typical causes: a CPU tensor "
            "in the step (keep the step's tensors on the GPU), an input changed in place, or "
            "shapes that vary (a ragged last batch: drop_remainder=True).",
        )

    def compiled(self, fn: Callable[..., Any], devices: tuple[torch.device, ...] | None = None) -> Callable[..., Any]:
        """``fn`` compiled with this function's options (once per function object and mode),
        for replicas on ``devices`` (None: not known)."""
        target, owner = _unbound(fn)
        mode = self._mode_for(devices)
        key = (mode, _replica_threads_on_cpu(devices))
        with self._lock:
            by_key = self._compiled.setdefault(target, {})
            attributed = by_key.get(key)
            if attributed is None:
                _settings.compiling(self)
                attributed = by_key[key] = self._attributed(
                    torch.compile(target, backend=self._backend(*key), fullgraph=self._fullgraph,
                                  dynamic=self._compile_dynamic()))
                watch_for_compiler()  # dynamo is loaded now: our eager wrappers stay eager
        return attributed if owner is None else functools.partial(attributed, owner)

    def compile_networks_apart(self, call: _Call, networks: Sequence[torch.nn.Module],
                               devices: tuple[torch.device, ...] | None) -> None:
        """For the rest of ``call``: where the step's strategy made several ``networks``, each
        network's forward runs as a graph of its own, compiled as this function says, inside
        the compiled replica step (which breaks its graph around each network call). Each
        network call then gets its own backward node, and a ``backward`` that reaches only some
        networks runs only their backward graphs, as in eager. Not with ``fullgraph=True``."""
        if self._fullgraph or self._split_networks is False or not networks:
            return
        if self._split_networks is None and len(networks) < 2:
            return
        # Dynamo keeps a graph per network for a forward that several networks share (one class).
        _settings.allow_graphs_for((len(devices) if devices else 1) * len(networks))
        key = (self._mode_for(devices), _replica_threads_on_cpu(devices))
        for module in networks:
            with self._lock:
                by_key = self._network_forwards.setdefault(module, {})
                forward = by_key.get(key)
                if forward is None:
                    forward = by_key[key] = self._network_forward(module, devices)
            # Given the module as an argument (not a closure over it): a copy made during the
            # call (``copy.deepcopy``, an EMA network) copies the argument, so its forward runs
            # with the copy.
            call.networks.replace(module, functools.partial(forward, module))

    def _network_forward(self, module: torch.nn.Module, devices: tuple[torch.device, ...] | None) -> Callable[..., Any]:
        """What ``module.forward`` is while networks are compiled apart, as a function of the
        module it is bound to: outside graphs (dynamo breaks the caller's graph before it), the
        module's forward compiled on its own when called from this function's compiled replica
        step, else the module's forward itself. It holds no reference to ``module`` (it is
        cached per module, weakly)."""
        own = module.__dict__.get("forward", _MISSING)
        if isinstance(own, functools.partial) and hasattr(own.func, _STANDS_FOR):
            own = own.func  # one installed here (by another call, or copied with its module)
        own = getattr(own, _STANDS_FOR, own)
        function = self
        if own is _MISSING or getattr(own, "__self__", None) is module:
            # The class's forward (compiled once for every instance of the class), or a method
            # of the module's own set on the instance.
            eager = type(module).forward if own is _MISSING else own.__func__
            compiled = self.compiled(eager, devices)

            def call_with_module(owner: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
                if _compiling.function is function:
                    return compiled(owner, *args, **kwargs)
                return eager(owner, *args, **kwargs)

            body = call_with_module
        else:  # another callable set as the instance's forward: called as it is
            eager_own, compiled_own = own, self.compiled(own, devices)

            def call_own(owner: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
                if _compiling.function is function:
                    return compiled_own(*args, **kwargs)
                return eager_own(*args, **kwargs)

            body = call_own
        forward = never_compiled(body)
        setattr(forward, _STANDS_FOR, own)
        return forward

    def replicas_take_turns(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether replicas that share a device should take turns in this run of the compiled
        replica step ``fn`` (see the module docstring), and records its kind of input."""
        target, _ = _unbound(fn)
        kind = _input_kind((args, kwargs))
        with self._lock:
            kinds = self._input_kinds.setdefault(target, _InputKinds())
            changed, kinds.last = kind != kinds.last, kind
            if changed and len(kinds.seen) < _KINDS_WITH_TURNS:
                kinds.seen.add(kind)
            return changed and kind in kinds.seen

    def _attributed(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        """``compiled``, calling which makes this function the one inductor's messages concern."""

        @functools.wraps(compiled)
        def attributed(*args: Any, **kwargs: Any) -> Any:
            previous, _compiling.function = _compiling.function, self
            try:
                return compiled(*args, **kwargs)
            finally:
                _compiling.function = previous

        return attributed

    def _compile_dynamic(self) -> bool | None:
        """``dynamic``; with an ``input_signature`` that has a ``None`` dimension, ``True``: the
        replicas' inputs are slices of the arguments, which dynamo sees as new tensors."""
        if self._dynamic is None and self.input_signature is not None and any(
                size is None for spec in nest.leaves(self.input_signature) for size in spec.shape):
            return True
        return self._dynamic

    def experimental_get_tracing_count(self) -> int:
        """The number of graphs compiled so far (the networks' own graphs included)."""
        return len(self._graphs)


def _unbound(fn: Callable[..., Any]) -> tuple[Any, Any]:
    """``fn``'s function and the object it is bound to (None for a plain function): compiled
    graphs and input kinds are kept per function, for every object it is bound to."""
    return (fn.__func__, getattr(fn, "__self__", None)) if hasattr(fn, "__func__") else (fn, None)


def _input_kind(value: Any) -> tuple[Any, ...]:
    """What of a run's arguments decides which graph dynamo picks: each tensor's shape, dtype,
    device and ``requires_grad`` (every replica's, for a ``PerReplica``), each Python scalar's
    and string's value, and the type of anything else."""
    kind: list[Any] = []
    for leaf in nest.leaves(value):
        for item in leaf.values if isinstance(leaf, DistributedValues) else (leaf,):
            if isinstance(item, torch.Tensor):
                kind.append((tuple(item.shape), item.dtype, item.device, item.requires_grad))
            elif item is None or isinstance(item, (bool, int, float, str)):
                kind.append((type(item), item))
            else:
                kind.append(type(item))
    return tuple(kind)


def _replica_threads_on_cpu(devices: tuple[torch.device, ...] | None) -> bool:
    """Whether the graphs run in several CPU replica threads: built to release the GIL."""
    return devices is not None and len(devices) > 1 and all(d.type == "cpu" for d in devices)


def function(fn: Callable[..., Any] | None = None, *, mode: str | None = None, fullgraph: bool = False,
             dynamic: bool | None = None, input_signature: Sequence[Any] | None = None,
             split_networks: bool | None = None) -> Any:
    """``@td.function`` or ``td.function(fn, mode=..., fullgraph=..., dynamic=..., input_signature=...,
    split_networks=...)``."""
    def wrap(target: Callable[..., Any]) -> Function:
        return Function(target, mode=mode, fullgraph=fullgraph, dynamic=dynamic, input_signature=input_signature,
                        split_networks=split_networks)

    return wrap if fn is None else wrap(fn)


class ReplicaStep(NamedTuple):
    """What ``strategy.run`` runs on each replica (``for_replicas``)."""

    fn: Callable[..., Any]
    compiled: bool  # inside a ``td.function`` call: ``fn`` compiled
    take_turns: bool  # compiled, and replicas that share a device should take turns in this run


def for_replicas(fn: Callable[..., Any], devices: tuple[torch.device, ...] | None = None,
                 args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                 networks: Callable[[], Sequence[torch.nn.Module]] | None = None) -> ReplicaStep:
    """What ``strategy.run(fn, args, kwargs)`` should run on replicas on ``devices`` (this
    process's): ``fn`` compiled inside a ``td.function`` call, else ``fn`` itself.
    ``networks``: the networks the strategy made (``Function.compile_networks_apart``).

    >>> for_replicas(print).compiled  # outside td.function
    False
    """
    if not _active.calls:
        return ReplicaStep(fn, compiled=False, take_turns=False)
    call = _active.calls[-1]
    call.runs += 1
    _settings.allow_graphs_for(len(devices) if devices else 1)
    compiled = call.function.compiled(fn, devices)
    if networks is not None:
        call.function.compile_networks_apart(call, networks(), devices)
    return ReplicaStep(compiled, compiled=True, take_turns=call.function.replicas_take_turns(fn, args, kwargs or {}))
