"""A Keras 3 model made in a strategy's scope, served by that strategy.

``serve(model, strategy, keras)`` (called by the scope listener when the model is made or
built in the scope) sets Keras' documented override points on that model instance, each a
thin layer over the model's own method:

- ``train_step``/``test_step``/``predict_step``: the step runs as Keras runs it, on the
  calling thread, with the whole global batch; while it runs it is the current step
  (``step_context``), and with several workers every worker first checks that it read the
  same batch (``input_check``).
- ``call``: within such a step, the model's forward on the global batch is spread over every
  replica of every worker and the outputs of the whole batch are returned (``forward``), so
  the loss and the metrics are one device's. Inside ``strategy.run`` (a custom training loop),
  each replica's forward as ``forward.in_replica`` runs it (random numbers of its own, state
  updates applied once). Anywhere else, the model's own call.
- ``fit``/``evaluate``/``predict`` and ``train_on_batch``/``test_on_batch``/
  ``predict_on_batch``: run in the strategy's scope (weights built lazily at the first batch
  are made there) on its device (``keras.device``), with the callbacks adapted to several
  workers (``callbacks``), after the checks that refuse what cannot be served.
- ``build``, and a ``call`` of a model not built yet (``model(x)`` before ``fit``): run in the
  strategy's scope when called outside every scope, so that the weights a model made in the
  scope builds later are the strategy's, wherever its first batch comes from.

The optimizer then sums the replicas' and workers' gradients before applying them
(``keras_seams``: ``Optimizer.apply``). The class is untouched: ``model.save`` writes a file
plain Keras loads, and one device runs the same program with no strategy.

>>> served_by(object()) is None
True
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from torch_distribute import context
from torch_distribute.errors import ContextError, KerasUnsupportedError
from torch_distribute.keras3 import callbacks as worker_callbacks
from torch_distribute.keras3 import forward, input_check, keras_seams, step_context

if TYPE_CHECKING:
    from torch_distribute.strategies import Strategy

_served: weakref.WeakKeyDictionary[Any, Strategy] = weakref.WeakKeyDictionary()


def served_by(model: Any) -> Strategy | None:
    """The strategy serving a Keras model, or ``None``."""
    try:
        return _served.get(model)
    except TypeError:  # not weak-referenceable
        return None


def check_strategy(strategy: Strategy, what: str) -> None:
    """Refuse a strategy that cannot train a Keras model as one device would."""
    if not strategy.extended.keeps_captured_tensors:
        raise KerasUnsupportedError(
            f"{what} in {type(strategy).__name__}.scope(): this strategy replaces the parameters "
            "of the modules made in its scope by sharded or remote ones, but a Keras variable holds "
            "its own whole tensor (Keras has no public way to make it hold a shard): its layers "
            "would compute with it, its optimizer would update it (its slot variables whole, next to "
            "the shards), and get_weights/save would read it, never the strategy's tensors. Keras 3 "
            "models train under OneDeviceStrategy, MirroredStrategy, CentralStorageStrategy and "
            "MultiWorkerMirroredStrategy; for FullyShardedStrategy or ParameterServerStrategy write "
            "the model as a torch.nn.Module (td.keras.Model gives it Keras' fit)."
        )


def check_no_keras_distribution(keras: ModuleType, strategy: Strategy) -> None:
    """Refuse Keras' own distribution API combined with a strategy (decided, not mixed)."""
    distribution = keras.distribution.distribution()
    if distribution is not None:
        raise KerasUnsupportedError(
            f"keras.distribution.set_distribution({type(distribution).__name__}(...)) is in force "
            f"together with {type(strategy).__name__}.scope(). On the torch backend Keras 3.15 "
            "does not distribute (it trains on one device and says nothing), and the two cannot "
            "share the model: use one. Remove set_distribution and keep the strategy (the same "
            "data parallelism: DataParallel(devices=[...]) is MirroredStrategy([...]) in one "
            "process, MultiWorkerMirroredStrategy across processes), or call "
            "keras.distribution.set_distribution(None)."
        )


def serve(model: Any, strategy: Strategy, keras: ModuleType) -> None:
    """Have ``strategy`` train ``model`` (a ``keras.Model``) from now on (idempotent)."""
    owner = served_by(model)
    if owner is strategy:
        return
    if owner is not None:
        raise ContextError(
            f"This Keras model belongs to the {type(owner).__name__} whose scope it was made in; "
            f"it cannot also be built in {type(strategy).__name__}.scope(). Make one model per strategy."
        )
    check_strategy(strategy, f"A Keras model ({type(model).__name__})")
    keras_seams.install(keras)
    _served[model] = strategy
    model_ref = weakref.ref(model)

    def wrap_step(name: str, kind: str) -> None:
        original = getattr(model, name)

        def step(data: Any) -> Any:
            with step_context.running(step_context.ActiveStep(model_ref(), strategy, kind)):
                input_check.check_same_batch(strategy, data, name)
                return original(data)

        step.__doc__ = original.__doc__
        _set(model, name, step)

    for name, kind in (("train_step", "train"), ("test_step", "test"), ("predict_step", "predict")):
        wrap_step(name, kind)

    original_call = model.call

    def call(*args: Any, **kwargs: Any) -> Any:
        step = step_context.current()
        if (step is None or step.forwarding or step.model is not model_ref() or not args
                or not _is_spread(strategy) or not _concrete(args[0])):
            if not getattr(model_ref(), "built", True):
                with home_scope(strategy, keras):  # a call that builds the model's weights
                    return original_call(*args, **kwargs)
            if _in_replica_of(strategy, keras):  # a custom training loop's forward
                return forward.in_replica(strategy, keras, model_ref(), original_call, args, kwargs)
            return original_call(*args, **kwargs)
        with step_context.flag(step, "forwarding"):
            return forward.spread(strategy, keras, model_ref(), args, kwargs, step.kind == "train")

    with contextlib.suppress(TypeError, ValueError):  # Keras reads call's signature (training=...)
        call.__signature__ = inspect.signature(original_call)  # type: ignore[attr-defined]
    call.__doc__ = original_call.__doc__
    _set(model, "call", call)

    original_build = model.build  # Keras' own wrapper of the class's build, on the instance

    @functools.wraps(original_build)
    def build(*args: Any, **kwargs: Any) -> Any:
        with home_scope(strategy, keras):
            return original_build(*args, **kwargs)

    _set(model, "build", build)

    for name in LOOPS:
        _set(model, name, _wrap_loop(model_ref, strategy, keras, getattr(model, name)))


#: A served model's methods that run in its strategy's scope, after the checks.
LOOPS = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")


@contextlib.contextmanager
def home_scope(strategy: Strategy, keras: ModuleType) -> Iterator[None]:
    """``strategy``'s scope (and its device for Keras' new variables) where no strategy's
    scope or ``run`` is in force; nothing where one is (its own, or another's: then that
    strategy's checks apply)."""
    if context.has_strategy():
        yield
        return
    with strategy.scope(), keras.device(str(strategy.extended.primary_device)):
        yield


def _set(model: Any, name: str, value: Callable[..., Any]) -> None:
    # torch.nn.Module.__setattr__ would do; object's keeps Keras' attribute tracking out of it.
    object.__setattr__(model, name, value)


def _is_spread(strategy: Strategy) -> bool:
    extended = strategy.extended
    return extended.num_local_replicas > 1 or extended.num_workers_in_sync > 1


def _in_replica_of(strategy: Strategy, keras: ModuleType) -> bool:
    """Whether this is a replica of ``strategy.run`` with several replicas, outside every
    ``keras.StatelessScope`` (a served step's replica forward runs in one already)."""
    replica = context.get_replica_context()
    return (replica is not None and replica.num_replicas_in_sync > 1 and replica.strategy is strategy
            and not keras_seams.in_stateless_scope(keras))


def _concrete(inputs: Any) -> bool:
    """Whether ``inputs`` hold real tensors (not Keras' symbolic ones while it builds)."""
    from torch_distribute import nest

    leaves = [leaf for leaf in nest.leaves(inputs) if leaf is not None]
    return bool(leaves) and all(isinstance(leaf, torch.Tensor) and leaf.device.type != "meta" for leaf in leaves)


def _wrap_loop(model_ref: Callable[[], Any], strategy: Strategy, keras: ModuleType,
               original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def loop(*args: Any, **kwargs: Any) -> Any:
        model = model_ref()
        check_no_keras_distribution(keras, strategy)
        if _is_spread(strategy) and getattr(model, "compiled", False) and model.jit_compile:
            raise KerasUnsupportedError(
                f"compile(jit_compile=True) under {type(strategy).__name__} with "
                f"{strategy.num_replicas_in_sync} replicas: Keras compiles its whole step with "
                "torch.compile, but the step's forward meets the other replicas, which no graph can "
                "hold. Compile with jit_compile=False (Keras' default on torch)."
            )
        bound = signature.bind(*args, **kwargs)
        extended = strategy.extended
        if extended.num_workers_in_sync > 1:
            if "callbacks" in signature.parameters:
                bound.arguments["callbacks"] = worker_callbacks.for_this_worker(
                    bound.arguments.get("callbacks"), strategy, keras)
            if "verbose" in signature.parameters and not extended.should_checkpoint:
                bound.arguments["verbose"] = 0  # the progress bar is the chief's
        with strategy.scope(), keras.device(str(extended.primary_device)):
            return original(*bound.args, **bound.kwargs)

    loop.__signature__ = signature  # type: ignore[attr-defined]
    loop.__doc__ = original.__doc__
    return loop
