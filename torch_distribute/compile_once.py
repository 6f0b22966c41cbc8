"""One compile per host: workers that reach the same graph together compile it once.

The workers of a job on one host (``torch-distribute launch --nproc N``, torchrun) start
together and reach their first ``td.function`` step together, so each would lower and build
the same graphs: N times the CPU for one result. Inductor keeps what it builds in its on-disk
FX-graph cache, under its cache directory (``TORCHINDUCTOR_CACHE_DIR``, by default one per
user and host), but a worker finds an entry only once another has finished writing it. So
``td.function`` runs inductor (``compile_with_inductor``) with each of the graphs it builds, a
step's forward and, when the first backward needs it, its backward, compiled under a lock: a
file in that directory named by a hash of the graph, its inputs and the compile options. The
first worker compiles; the others wait for it, then compile too and find its result in the
cache. A marker left next to the lock says the graph is done, and whoever comes later (a
restarted worker, the next run) goes straight to the cache.

Inductor's own keys decide what is reused, so nothing is ever shared wrongly: a graph whose
inductor key differs after all is compiled anew, and the numerics are those of a compile of
one's own. The lock's key only decides who waits, and it names each input's device: ranks on
different GPUs (which inductor keys apart, the device index being part of its key) never wait
for one another. Nothing waits where it would gain nothing: with inductor's FX-graph cache
off (``torch.compiler.config.force_disable_caches``, ``torch._inductor.config.fx_graph_cache
= False``), without ``fcntl`` (Windows), for a graph that inductor would not cache (it is
marked, and every worker compiles it at once, as without the lock), or with
``TD_COMPILE_ONCE=0``. A worker waits at most ``torch._inductor.config.file_lock_timeout``
seconds (600 by default, inductor's limit for its own kernel locks), then compiles anyway; the
lock is ``flock``'s, which the system releases when its holder dies. A compile under the lock
waits for no other worker (it runs no collective), so the wait always ends; in one process,
dynamo's own compile lock already lets one thread compile at a time.

What each worker still does itself: dynamo's tracing of the step and AOTAutograd's of the
graph (its cache entry is written only after the first backward), and loading the result.

>>> import torch
>>> relu = torch.fx.symbolic_trace(torch.nn.ReLU())
>>> graph_key(relu, [torch.ones(2)], "default") == graph_key(relu, [torch.ones(2, device="meta")], "default")
False
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import torch

from torch_distribute import log
from torch_distribute.errors import InvalidArgumentError

try:
    import fcntl
except ImportError:  # Windows: every worker compiles, as without this module
    fcntl = None  # type: ignore[assignment]

__all__ = ["ENVIRONMENT_VARIABLE", "compile_shared", "compile_with_inductor", "enabled", "graph_key"]

T = TypeVar("T")

ENVIRONMENT_VARIABLE = "TD_COMPILE_ONCE"
_DIRECTORY = "td_compile_once"  # under inductor's cache directory: cleared with it
_POLL_S = 0.05
# compile_fx_inner's keyword arguments that change what it builds, as plain values (the rest
# are objects whose repr would differ between processes: left out, they only make two
# processes wait for each other where inductor's own key may still tell them apart).
_INNER_OPTIONS = ("is_backward", "is_inference", "static_input_idxs", "cpp_wrapper", "fx_wrapper", "aot_mode",
                  "layout_opt", "compile_region_name")
_logger = log.get_logger("compile")


class _Holding(threading.local):
    def __init__(self) -> None:
        self.lock = False  # this thread holds a lock now: a nested compile takes none


_holding = _Holding()


def enabled() -> bool:
    """Whether graphs are compiled once per host: inductor's local caches on, ``fcntl``
    available, and ``TD_COMPILE_ONCE`` unset or ``1`` (``0`` turns it off).

    >>> enabled() in (True, False)
    True
    """
    setting = os.environ.get(ENVIRONMENT_VARIABLE, "1").strip()
    if setting not in ("0", "1"):
        raise InvalidArgumentError(
            f"{ENVIRONMENT_VARIABLE} must be 1 (workers on one host compile each graph once, the "
            f"default) or 0 (each compiles its own), got {setting!r}.")
    if setting == "0" or fcntl is None:
        return False
    import torch._inductor.config as inductor_config

    return bool(inductor_config.fx_graph_cache) and not inductor_config.force_disable_caches


def graph_key(graph: torch.fx.GraphModule, example_inputs: Sequence[Any], options: Hashable) -> str:
    """A hash of what decides the compiled result, as far as this process can tell cheaply:
    the graph's nodes, each input's kind (a tensor's type, shape, strides, dtype, device with
    its index, ``requires_grad``), the constants the graph holds, the compile ``options``, the
    grad mode and torch's version. Equal in two processes that compile the same step on the
    same device.

    >>> relu = torch.fx.symbolic_trace(torch.nn.ReLU())
    >>> graph_key(relu, [torch.ones(2)], "a") == graph_key(relu, [torch.ones(2)], "a")
    True
    >>> graph_key(relu, [torch.ones(2)], "a") == graph_key(relu, [torch.ones(3)], "a")
    False
    """
    parts: list[str] = [torch.__version__, repr(options), str(torch.is_grad_enabled()), str(graph.graph)]
    for value in example_inputs:
        parts.append(_describe(value))
    for node in graph.graph.nodes:
        if node.op == "get_attr":
            parts.append(f"{node.target}: {_describe(_attribute(graph, str(node.target)))}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _attribute(graph: torch.nn.Module, dotted: str) -> Any:
    found: Any = graph
    for name in dotted.split("."):
        found = getattr(found, name, None)
    return found


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        try:
            strides = str(tuple(value.stride()))
        except (RuntimeError, NotImplementedError):  # sparse and nested tensors have none
            strides = "(no strides)"
        return (f"{type(value).__name__}{tuple(value.shape)}{strides} {value.layout} {value.dtype} "
                f"{value.device} {value.requires_grad}")
    if value is None or isinstance(value, (bool, int, float, str, torch.SymInt, torch.SymFloat)):
        return f"{type(value).__name__} {value}"
    return type(value).__name__


def compile_with_inductor(inductor: Any, graph: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """What ``inductor(graph, example_inputs)`` returns (``inductor``: a
    ``torch._TorchCompileInductorWrapper``), each graph inductor builds on the way (forward,
    backward) compiled once per host (``compile_shared``)."""
    if not enabled():
        return inductor(graph, example_inputs)
    from torch._inductor.compile_fx import compile_fx

    patches = dict(inductor.config)
    inner = functools.partial(_compile_inner_once, options=repr(sorted(patches.items())))
    # What the wrapper's __call__ does, with inductor's inner compile wrapped. torch 2.11's
    # wrapper has no region name (and its compile_fx takes none).
    region = {"compile_region_name": inductor.name} if hasattr(inductor, "name") else {}
    return compile_fx(graph, example_inputs, inner_compile=inner, config_patches=patches, **region)


def _compile_inner_once(graph: torch.fx.GraphModule, example_inputs: Sequence[Any], *, options: str,
                        **kwargs: Any) -> Any:
    """Inductor's ``compile_fx_inner`` for one graph (AOTAutograd's forward or backward), under
    the host's lock for it."""
    from torch._inductor.compile_fx import compile_fx_inner

    cudagraphs = kwargs.get("cudagraphs")
    kind = (options, *(repr(kwargs.get(name)) for name in _INNER_OPTIONS),
            repr(getattr(cudagraphs, "value", cudagraphs)))
    return compile_shared(functools.partial(compile_fx_inner, **kwargs), graph, example_inputs, kind)


def compile_shared(compile_graph: Callable[[torch.fx.GraphModule, Sequence[Any]], T], graph: torch.fx.GraphModule,
                   example_inputs: Sequence[Any], options: Hashable) -> T:
    """``compile_graph(graph, example_inputs)``, run by one process of the host at a time for
    a graph that none has compiled yet (see the module docstring); ``options`` are the
    compile options that ``compile_graph`` applies (part of the lock's key)."""
    if _holding.lock or not enabled():
        return compile_graph(graph, example_inputs)
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    key = graph_key(graph, example_inputs, options)
    directory = os.path.join(cache_dir(), _DIRECTORY, key[:2])
    done = os.path.join(directory, key + ".done")
    if os.path.exists(done):
        return compile_graph(graph, example_inputs)
    descriptor = _lock(os.path.join(directory, key + ".lock"), float(inductor_config.file_lock_timeout))
    if descriptor is None:
        return compile_graph(graph, example_inputs)
    first = not os.path.exists(done)
    try:
        if first:
            _holding.lock = True
            try:
                bypassed = _bypasses()
                compiled = compile_graph(graph, example_inputs)
            finally:
                _holding.lock = False
            _mark_done(done, cached=_bypasses() == bypassed)
            return compiled
    finally:
        os.close(descriptor)  # lets go of the lock
    return compile_graph(graph, example_inputs)  # compiled by another worker: from the caches


def _lock(path: str, timeout_s: float) -> int | None:
    """The descriptor of ``path`` locked exclusively, waiting up to ``timeout_s``; None if
    the lock could not be had (the caller compiles without it)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as error:  # e.g. a cache directory this process may not write
        _logger.info("compiling without the host's compile lock: %s", error)
        return None
    deadline = time.monotonic() + timeout_s
    waited = False
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if waited:
                _logger.debug("another process compiled this graph: loading it from inductor's caches")
            return descriptor
        except BlockingIOError:
            pass
        except OSError as error:  # a file system without flock
            os.close(descriptor)
            _logger.info("compiling without the host's compile lock: %s", error)
            return None
        if time.monotonic() >= deadline:
            os.close(descriptor)
            _logger.warning("waited %.0f s for another process to compile the same graph (%s); compiling "
                            "it here as well", timeout_s, path)
            return None
        if not waited:
            _logger.debug("another process is compiling this graph: waiting for it (%s)", path)
            waited = True
        time.sleep(_POLL_S)


def _bypasses() -> int:
    """How often inductor's caches were bypassed in this process (a graph not cacheable)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_bypass"])


def _mark_done(path: str, cached: bool) -> None:
    """Leave the marker: later compiles of this graph take no lock (its result is cached, or
    it was not cacheable and every process compiles it)."""
    try:
        with open(path + ".tmp" + str(os.getpid()), "w") as marker:
            marker.write("cached\n" if cached else "not cached: every process compiles it\n")
        os.replace(path + ".tmp" + str(os.getpid()), path)
    except OSError as error:
        _logger.info("could not mark a compiled graph as done (%s): %s", path, error)
