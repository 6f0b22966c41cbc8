"""Warn when a loss that expects probabilities (``from_logits=False``) is given logits.

Keras' cross-entropies default to ``from_logits=False``, while a torch module returns logits:
``compile(loss="sparse_categorical_crossentropy")`` on such a model clips the logits into
[1e-7, 1 - 1e-7] and trains to a wrong loss, without a word. ``ProbabilityCheck`` looks at the
first few non-empty batches a loss object receives (a ``min``/``max``, and for categorical
losses the sum over the class axis) and warns once, naming ``from_logits=True``. After those
calls it costs nothing: the check reads the tensor back to the host, which would otherwise
cost a device synchronisation at every step. Steps compiled by ``torch.compile``
(``jit_compile=True``) are not checked.

>>> import torch, warnings
>>> check = ProbabilityCheck("SparseCategoricalCrossentropy", "sparse_categorical_crossentropy", categorical=True)
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     check(torch.tensor([[2.0, -1.0]]))
>>> "from_logits=True" in str(caught[0].message)
True
"""

from __future__ import annotations

import threading
import warnings

import torch

from torch_distribute.eager import never_compiled

CHECKED_CALLS = 3  # non-empty batches looked at per loss object; logits show in the first one


class ProbabilityCheck:
    """Called with each batch of predictions a ``from_logits=False`` loss receives."""

    def __init__(self, class_name: str, loss_name: str, categorical: bool):
        self.class_name = class_name
        self.loss_name = loss_name
        self.categorical = categorical
        self._calls_left = CHECKED_CALLS
        self._lock = threading.Lock()  # replicas call one loss object from several threads

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __call__(self, y_pred: torch.Tensor) -> None:
        # Not while torch.compile traces (jit_compile=True): the countdown would change under
        # its guard and recompile the step at each of the first calls.
        if self._calls_left <= 0 or torch.compiler.is_compiling() or not isinstance(y_pred, torch.Tensor) or y_pred.numel() == 0:
            return
        self._inspect(y_pred)

    @never_compiled
    def _inspect(self, y_pred: torch.Tensor) -> None:
        with self._lock:
            if self._calls_left <= 0:
                return
            self._calls_left -= 1
        problem = _not_probabilities(y_pred.detach(), self.categorical)
        if problem is None:
            return
        with self._lock:
            if self._calls_left < 0:
                return  # another replica warned already
            self._calls_left = -1
        warnings.warn(
            f"The loss {self.loss_name!r} expects probabilities (from_logits=False, Keras' default) "
            f"but its predictions {problem}: they look like logits, which this loss clips into "
            f"[1e-7, 1 - 1e-7], so the model trains to a wrong loss. A torch model returns logits: "
            f"compile with loss=td.keras.losses.{self.class_name}(from_logits=True) (or end the model with "
            f"{'a softmax' if self.categorical else 'a sigmoid'}).",
            UserWarning,
            stacklevel=2,
        )


def _not_probabilities(y_pred: torch.Tensor, categorical: bool) -> str | None:
    """What shows that ``y_pred`` is not probabilities, or None."""
    values = y_pred.float()
    low, high = (float(v) for v in torch.aminmax(values))
    if low < 0.0 or high > 1.0:
        return f"range over [{low:.3g}, {high:.3g}], outside [0, 1]"
    if categorical and values.dim() >= 1:
        sums = values.sum(-1)
        tolerance = max(1e-3, torch.finfo(y_pred.dtype).eps if y_pred.is_floating_point() else 0.0)
        worst = float((sums - 1.0).abs().max())
        if worst > tolerance:
            return f"do not sum to 1 along the class axis (off by up to {worst:.3g})"
    return None

