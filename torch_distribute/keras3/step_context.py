"""The training, test or predict step of a served Keras model running on this thread.

Keras' ``fit``, ``evaluate`` and ``predict`` call the model's ``train_step``, ``test_step`` or
``predict_step`` once per global batch, on the calling thread. While one runs, the model's
forward is spread over the strategy's replicas (``forward.py``) and its optimizer sums the
replicas' gradients before applying them (``keras_seams.py``): both read the step from here.
A forward anywhere else (a callback calling ``model(x)``, a replica's own forward) is a plain
Keras call.

>>> current() is None
True
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch_distribute.strategies import Strategy


class ActiveStep:
    """One step of ``model`` under ``strategy``: ``kind`` is ``"train"``, ``"test"`` or
    ``"predict"``. ``forwarding`` is set while the replicas run the forward (their own calls
    of the model are plain); ``gradients_global`` while an optimizer applies gradients
    already summed over the replicas (a ``LossScaleOptimizer`` calling its inner one)."""

    __slots__ = ("model", "strategy", "kind", "forwarding", "gradients_global")

    def __init__(self, model: Any, strategy: Strategy, kind: str):
        self.model = model
        self.strategy = strategy
        self.kind = kind
        self.forwarding = False
        self.gradients_global = False


_local = threading.local()


def current() -> ActiveStep | None:
    """The step running on this thread, if any."""
    return getattr(_local, "step", None)


@contextlib.contextmanager
def running(step: ActiveStep) -> Iterator[ActiveStep]:
    """Make ``step`` the current one on this thread while the block runs."""
    previous = current()
    _local.step = step
    try:
        yield step
    finally:
        _local.step = previous


@contextlib.contextmanager
def flag(step: ActiveStep, name: str) -> Iterator[None]:
    """Set ``step.<name>`` (``forwarding`` or ``gradients_global``) while the block runs."""
    previous = getattr(step, name)
    setattr(step, name, True)
    try:
        yield
    finally:
        setattr(step, name, previous)
