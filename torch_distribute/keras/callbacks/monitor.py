"""Watching a logged quantity for improvement (``ModelCheckpoint``, ``EarlyStopping``...)."""

from __future__ import annotations

import math
import warnings
from typing import Any

from torch_distribute.errors import InvalidArgumentError


class Monitor:
    """Whether a new value of ``monitor`` beats the best so far by more than ``min_delta``.

    ``mode="auto"``: higher is better for accuracies and AUC, lower for everything else.

    >>> m = Monitor("val_accuracy")
    >>> m.improved(0.5), m.improved(0.4), m.improved(0.6)
    (True, False, True)
    """

    def __init__(self, monitor: str, mode: str = "auto", min_delta: float = 0.0, baseline: float | None = None,
                 owner: str = "callback"):
        if mode not in ("auto", "min", "max"):
            raise InvalidArgumentError(f"{owner} mode must be 'auto', 'min' or 'max', got {mode!r}.")
        if mode == "auto":
            name = monitor.removeprefix("val_")
            mode = "max" if "acc" in name or "auc" in name or name.startswith("fmeasure") else "min"
        self.monitor = monitor
        self.mode = mode
        self.min_delta = abs(min_delta)
        self.best = baseline if baseline is not None else (-math.inf if mode == "max" else math.inf)
        self._owner = owner

    def value(self, logs: dict[str, Any] | None, warn: bool = True) -> float | None:
        """The monitored value in ``logs``; ``None`` (and a warning naming the keys) if absent."""
        value = (logs or {}).get(self.monitor)
        if value is None and warn:
            warnings.warn(
                f"{self._owner} is watching {self.monitor!r}, which is not in the logs "
                f"(available: {', '.join(sorted(logs or {}))}); pass validation_data to fit for "
                "'val_' metrics, or monitor one of the available names.",
                stacklevel=3,
            )
        return None if value is None else float(value)

    def is_better(self, value: float, reference: float) -> bool:
        if self.mode == "max":
            return value - self.min_delta > reference
        return value + self.min_delta < reference

    def improved(self, value: float) -> bool:
        """Whether ``value`` beats the best so far; if so it becomes the best."""
        if self.is_better(value, self.best):
            self.best = value
            return True
        return False
