"""Keras' progress bar: ``5/5 [==============================] - 1s 10ms/step - loss: 0.1234``.

On a terminal the line is redrawn in place (at most every ``interval`` seconds); in a log
file or a notebook without a terminal only the final line of each epoch is printed, so logs
stay one line per epoch. ``verbose=2`` prints one summary line per epoch.

>>> import io
>>> from torch_distribute.keras.progbar import Progbar
>>> out = io.StringIO()
>>> bar = Progbar(2, stream=out)
>>> bar.update(1, {"loss": 0.5})
>>> bar.update(2, {"loss": 0.25}, finalize=True)
>>> out.getvalue().split(" - ")[0]
'2/2 [==============================]'
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from typing import IO


class Progbar:
    """A progress bar for ``target`` steps (``None``: unknown)."""

    def __init__(self, target: int | None, width: int = 30, verbose: int = 1, interval: float = 0.05,
                 unit_name: str = "step", stream: IO[str] | None = None):
        self.target = target
        self.width = width
        self.verbose = verbose
        self.interval = interval
        self.unit_name = unit_name
        self.stream = stream if stream is not None else sys.stdout
        self._dynamic = bool(getattr(self.stream, "isatty", lambda: False)())
        self._start = time.perf_counter()
        self._last_update = 0.0
        self._previous_width = 0

    def update(self, current: int, values: Mapping[str, float] | None = None, finalize: bool | None = None) -> None:
        """Show ``current`` steps done and the latest ``values`` (already averaged)."""
        if finalize is None:
            finalize = self.target is not None and current >= self.target
        now = time.perf_counter()
        if self.verbose == 0 or (self.verbose == 2 and not finalize):
            return
        if not finalize and (not self._dynamic or now - self._last_update < self.interval):
            return
        self._last_update = now
        elapsed = now - self._start
        metrics = "".join(f" - {name}: {_format(value)}" for name, value in (values or {}).items())
        if self.verbose == 2:
            line = f"{current}/{self.target if self.target is not None else current} - {_duration(elapsed)}{metrics}"
        else:
            line = f"{self._bar(current)} - {self._timing(current, elapsed, finalize)}{metrics}"
        if self._dynamic:
            padding = " " * max(0, self._previous_width - len(line))
            self.stream.write("\r" + line + padding)
            self._previous_width = len(line)
            if finalize:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def _bar(self, current: int) -> str:
        if self.target is None:
            return f"{current:7d}/Unknown"
        digits = int(math.log10(max(self.target, 1))) + 1
        done = int(self.width * min(current, self.target) / max(self.target, 1))
        arrow = ">" if current < self.target and done < self.width else ""
        fill = "=" * (done - (1 if arrow and done else 0)) + arrow
        return f"{current:{digits}d}/{self.target} [{fill}{'.' * (self.width - len(fill))}]"

    def _timing(self, current: int, elapsed: float, finalize: bool) -> str:
        per_unit = elapsed / max(current, 1)
        if not finalize and self.target is not None:
            return f"ETA: {_duration(per_unit * (self.target - current))}"
        if per_unit >= 1:
            rate = f"{per_unit:.0f}s/{self.unit_name}"
        elif per_unit >= 1e-3:
            rate = f"{per_unit * 1e3:.0f}ms/{self.unit_name}"
        else:
            rate = f"{per_unit * 1e6:.0f}us/{self.unit_name}"
        return f"{_duration(elapsed)} {rate}"


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{int(seconds // 3600)}:{int(seconds % 3600 // 60):02d}:{int(seconds % 60):02d}"
    if seconds >= 60:
        return f"{int(seconds // 60)}:{int(seconds % 60):02d}"
    return f"{seconds:.0f}s"


def _format(value: float) -> str:
    value = float(value)
    return f"{value:.4f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.4e}"
