"""Everything the Keras 3 integration changes in Keras, and what it relies on, in one table.

Keras 3 on torch offers no distribution hook: its ``fit`` runs ``train_step`` on the calling
thread, a model calls its variables' tensors directly, and an optimizer updates them itself.
So the integration uses Keras' documented override points on the model it serves (its
``call``, ``train_step``/``test_step``/``predict_step``, ``fit``/``evaluate``/``predict``, set
on that instance only: ``serving.py``) and wraps four public methods of Keras: the optimizer
classes' ``apply(grads, trainable_variables=None)``, which every optimizer's update goes
through (``apply_gradients`` calls it); ``keras.Model.__init__``, so that a model made in a
scope belongs to that strategy even when it has no weights yet (TensorFlow's Keras records
the strategy there too); ``keras.metrics.Metric.__init__``, so that a metric updated inside
``strategy.run`` is sync-on-read (``replica_metrics.py``); and ``keras.Variable.assign``,
which refuses, by name, a metric variable updated inside ``run`` by a metric made before
that. Nothing private of Keras is replaced.

Two Keras internals are read (nothing is changed through them): a layer's output carries its
mask in an attribute Keras sets and reads itself (``keras.src.backend.get_keras_mask`` /
``set_keras_mask``; Keras has no public accessor), which the losses use. The replicas'
outputs are joined into new tensors, so their masks are joined too (``output_mask``,
``set_output_mask``), else a masked sequence model would train on its padding. And
``keras.src.backend.in_stateless_scope()``: an assignment inside a ``keras.StatelessScope``
is collected, not applied, so ``Variable.assign``'s check lets it through.

Each replica draws random numbers of its own (``replica_random.py``) through what Keras
documents of ``keras.random.SeedGenerator``: its state is a variable named
``seed_generator_state`` holding ``[seed, counter]``, and ``next()`` draws ``seed + counter``
and advances the counter (the test of this table checks that on the installed Keras).

``CHANGES`` lists them with why and when; ``KERAS_TARGETS`` is the call shape each relies on,
as found on the Keras versions in ``loaded.TESTED_KERAS``. ``tests/test_keras3.py`` compares
them with the installed Keras, so a Keras release that changes one fails in CI first.

>>> [change.target for change in CHANGES][:1]
['keras.optimizers.Optimizer.apply']
>>> "keras.Model.__init__" in [change.target for change in CHANGES]
True
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch_distribute import context
from torch_distribute.keras3 import gradients, replica_metrics, step_context


@dataclasses.dataclass(frozen=True)
class Change:
    """One change to Keras (or to an object Keras made), and why it is made.

    >>> Change("keras.X.y", "wrapped", "no hook", "at first use", "never").target
    'keras.X.y'
    """

    target: str  #: what is changed
    change: str  #: what is done to it
    why: str  #: why Keras offers no public hook instead
    installed: str  #: when it is made
    undone: str  #: when it is undone, or why not


_APPLY_WHY = ("a Keras optimizer updates its variables itself (not through torch.optim), once "
              "per call; under several replicas it must apply, once, the gradient summed over "
              "every replica and worker, and Keras has no distribution hook on torch")
_FIRST_MODEL = "when a strategy's scope is first entered with Keras imported (scope listener)"
_MODEL_MADE_WHY = ("a model whose first layer has no input shape (TensorFlow's tutorials write it so) has "
                   "no weights until its first batch, and nothing of torch (no module, no parameter) is "
                   "registered while Keras makes it, so the torch hooks that find other models in a scope "
                   "cannot see it; Keras has no hook at a model's construction. TensorFlow's Keras "
                   "records the strategy in force in Model.__init__ and builds the variables in it later")
_KEPT = ("never in a program (it passes through at once outside strategy.run and outside a served "
         "model's step); uninstall() undoes it, for tests")

CHANGES: tuple[Change, ...] = (
    Change("keras.optimizers.Optimizer.apply", "wrapped: inside strategy.run with several replicas "
           "it sums every replica's gradients in a merge_call and applies once; in a served "
           "model's train_step it sums the replicas' and workers' shares first (gradients.py)",
           _APPLY_WHY, _FIRST_MODEL, _KEPT),
    Change("keras.optimizers.LossScaleOptimizer.apply", "wrapped as Optimizer.apply (it defines its "
           "own): the inf/NaN check sees the summed gradient; its inner optimizer's apply then "
           "passes through", _APPLY_WHY, _FIRST_MODEL, _KEPT),
    Change("keras.optimizers.MultiOptimizer.apply", "wrapped as Optimizer.apply (it defines its "
           "own); its inner optimizers' apply then pass through", _APPLY_WHY, _FIRST_MODEL, _KEPT),
    Change("keras.Model.__init__", "wrapped: after Keras' own __init__, a model made in a strategy's "
           "scope is served by that strategy (serving.serve), so its weights, built at its first batch "
           "or build(), are built in that scope; outside every scope it passes through",
           _MODEL_MADE_WHY, _FIRST_MODEL, _KEPT),
    Change("keras.metrics.Metric.__init__", "wrapped: after Keras' own __init__, the metric's "
           "update_state/result/reset_state are set on the instance: inside strategy.run with several "
           "replicas each replica accumulates its own state (stateless_update_state), and result() "
           "outside run adds every replica's and worker's first (replica_metrics.py); elsewhere they "
           "pass through",
           "a metric's variables are plain tensors shared by every replica thread and local to each "
           "worker; Keras has no distribution hook on torch, and every metric class defines its own "
           "update_state, so only the constructor they all call reaches every metric",
           _FIRST_MODEL, _KEPT),
    Change("keras.Variable.assign", "wrapped: a metric variable (synchronization='on_read') assigned "
           "inside strategy.run with several replicas, outside a StatelessScope, by a metric not served "
           "(made before the first scope) raises KerasUnsupportedError; every other assign passes through",
           "a metric made before the wrappers exist cannot be served, and its update inside run would "
           "race between replica threads and stay local to each worker; every metric update ends in "
           "this method", _FIRST_MODEL, _KEPT),
    Change("a served model's call, train_step, test_step, predict_step, fit, evaluate, predict",
           "set on that instance (its class is untouched, so model.save records plain Keras): the "
           "forward is spread over the replicas within a step, and fit runs in the strategy's "
           "scope with its callbacks adapted to several workers; build, and a call that builds, run "
           "in the strategy's scope (serving.py)",
           "these are the documented ways to change what fit does; a Keras model made in a scope "
           "is found by the torch module registration hooks the strategy already uses",
           "when the model is made (or built) in a strategy's scope", "never: the model belongs to "
           "its strategy, as in TensorFlow"),
)

#: What each change relies on in Keras: the call shape of each target, on the tested versions.
KERAS_TARGETS: dict[str, str] = {
    "optimizers.Optimizer.apply": "(self, grads, trainable_variables=None)",
    "optimizers.LossScaleOptimizer.apply": "(self, grads, trainable_variables=None)",
    "optimizers.MultiOptimizer.apply": "(self, grads, trainable_variables=None)",
    "Model.__init__": "(self, *args, **kwargs)",
    "metrics.Metric.__init__": "(self, dtype=None, name=None)",
    "metrics.Metric.stateless_update_state": "(self, metric_variables, *args, **kwargs)",
    "metrics.Metric.stateless_result": "(self, metric_variables)",
    "metrics.Metric.stateless_reset_state": "(self)",
    "Variable.assign": "(self, value)",
    "src.backend.in_stateless_scope": "()",
    "Model.train_step": "(self, data)",
    "Model.test_step": "(self, data)",
    "Model.predict_step": "(self, data)",
    "random.SeedGenerator.next": "(self, ordered=True)",
    "src.backend.get_keras_mask": "(x)",
    "src.backend.set_keras_mask": "(x, mask)",
    "Model.fit": ("(self, x=None, y=None, batch_size=None, epochs=1, verbose='auto', callbacks=None, "
                  "validation_split=0.0, validation_data=None, shuffle=True, class_weight=None, "
                  "sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None, "
                  "validation_batch_size=None, validation_freq=1)"),
}

_APPLY_CLASSES = ("Optimizer", "LossScaleOptimizer", "MultiOptimizer")
_lock = threading.Lock()
_undo: list[Callable[[], None]] = []
_depth = threading.local()  # wrapped applies running on this thread (the outermost sums)


def call_shape(keras: ModuleType, dotted: str) -> str:
    """The signature of ``keras.<dotted>`` as text (what ``KERAS_TARGETS`` records).

    >>> import sys
    >>> keras = sys.modules.get("keras")
    >>> keras is None or call_shape(keras, "Model.train_step") == "(self, data)"
    True
    """
    target: Any = keras
    for part in dotted.split("."):
        target = getattr(target, part)
    return str(inspect.signature(target))


def output_mask(keras: ModuleType, tensor: Any) -> Any:
    """The mask Keras attached to a layer's output, or ``None``."""
    return keras.src.backend.get_keras_mask(tensor)


def in_stateless_scope(keras: ModuleType) -> bool:
    """Whether a ``keras.StatelessScope`` is open on this thread (Keras' own test)."""
    return bool(keras.src.backend.in_stateless_scope())


def set_output_mask(keras: ModuleType, tensor: Any, mask: Any) -> None:
    """Attach ``mask`` to ``tensor`` as Keras attaches a layer's output mask."""
    keras.src.backend.set_keras_mask(tensor, mask)


def _wrap_apply(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        depth = getattr(_depth, "value", 0)
        if depth:
            return original(self, grads, trainable_variables)
        _depth.value = 1
        try:
            return _route(original, self, grads, trainable_variables)
        finally:
            _depth.value = 0

    apply.__torch_distribute_wrapped__ = True  # type: ignore[attr-defined]
    return apply


def _route(original: Callable[..., Any], optimizer: Any, grads: Any, variables: Any) -> Any:
    replica = context.get_replica_context()
    if replica is not None and replica.num_replicas_in_sync > 1:
        if variables is None:
            variables = _require_variables(optimizer)
        return gradients.apply_in_replica(
            replica, lambda summed, vs: original(optimizer, summed, vs), list(grads), list(variables))
    step = step_context.current()
    if step is not None and step.kind == "train" and not step.forwarding:
        strategy = step.strategy
        if strategy.num_replicas_in_sync > 1:
            if variables is None:
                variables = _require_variables(optimizer)
            variables = list(variables)
            grads = gradients.sum_for_step(strategy, list(grads), variables)
    return original(optimizer, grads, variables)


def _require_variables(optimizer: Any) -> list[Any]:
    from torch_distribute.errors import KerasUnsupportedError

    raise KerasUnsupportedError(
        f"{type(optimizer).__name__}.apply(grads) was called without its variables under a "
        "strategy with several replicas; pass them: optimizer.apply(grads, model.trainable_variables)."
    )


_model_made: Callable[[Any], None] | None = None


def install(keras: ModuleType, model_made: Callable[[Any], None] | None = None) -> None:
    """Make the changes of ``CHANGES`` to Keras' classes (idempotent, thread-safe).

    ``model_made(model)`` is called after every ``keras.Model``'s own ``__init__`` from now
    on (the scope listener's: it serves a model made in a scope)."""
    global _model_made
    with _lock:
        if model_made is not None:
            _model_made = model_made
        if _undo:
            return
        for name in _APPLY_CLASSES:
            cls = getattr(keras.optimizers, name, None)
            if cls is None or getattr(cls.__dict__.get("apply"), "__torch_distribute_wrapped__", False):
                continue
            own = cls.__dict__.get("apply")
            setattr(cls, "apply", _wrap_apply(cls.apply))  # noqa: B010 - a class attribute, undone below
            _undo.append(functools.partial(_restore, cls, own))
        for cls, hook in ((keras.Model, _model_made_hook), (keras.metrics.Metric, _metric_made_hook(keras))):
            own_init = cls.__dict__["__init__"]
            if not getattr(own_init, "__torch_distribute_wrapped__", False):
                cls.__init__ = _after_init(own_init, hook)
                _undo.append(functools.partial(_restore, cls, own_init, "__init__"))
        variable_class = keras.Variable
        if not getattr(variable_class.assign, "__torch_distribute_wrapped__", False):
            own_assign = variable_class.__dict__.get("assign")
            variable_class.assign = _checked_assign(variable_class.assign, keras)
            _undo.append(functools.partial(_restore, variable_class, own_assign, "assign"))


def _model_made_hook(model: Any) -> None:
    hook = _model_made
    if hook is not None:
        hook(model)


def _metric_made_hook(keras: ModuleType) -> Callable[[Any], None]:
    return lambda metric: replica_metrics.serve(metric, keras)


def _after_init(original: Callable[..., None], hook: Callable[[Any], None]) -> Callable[..., None]:
    """``original`` (a class's ``__init__``), then ``hook(self)``."""
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        hook(self)

    __init__.__torch_distribute_wrapped__ = True  # type: ignore[attr-defined]
    return __init__


def _checked_assign(original: Callable[..., Any], keras: ModuleType) -> Callable[..., Any]:
    @functools.wraps(original)
    def assign(self: Any, value: Any) -> Any:
        replica_metrics.check_assign(self, keras)
        return original(self, value)

    assign.__torch_distribute_wrapped__ = True  # type: ignore[attr-defined]
    return assign


def _restore(cls: type, own: Any, name: str = "apply") -> None:
    if own is None:
        delattr(cls, name)  # back to the inherited method
    else:
        setattr(cls, name, own)


def installed() -> bool:
    """Whether ``install`` is in force."""
    return bool(_undo)


def uninstall() -> bool:
    """Undo ``install`` (for tests); returns whether anything was installed."""
    with _lock:
        done = bool(_undo)
        while _undo:
            _undo.pop()()
        return done
