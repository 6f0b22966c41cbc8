"""The library's ``logging`` loggers: what the strategies decide and what collectives do.

Everything is logged to ``logging.getLogger("torch_distribute")`` or a child of it
(``torch_distribute.<part>``, from ``get_logger("<part>")``), and the library adds no handler:
configure logging as usual to see the records, e.g. ``logging.basicConfig(level=logging.INFO)``.
The logger's level comes from the environment variable ``TD_LOG_LEVEL`` (``INFO``,
``DEBUG``, ... or a number), read when the package is imported, or from
``td.config.set_log_level``.

- INFO: what each strategy decided (its devices, workers, cross-device ops, the cluster
  resolver that found the cluster, the process-group backend and the rendezvous address);
- DEBUG: each collective between workers, numbered, with what it is for.

>>> get_logger("collectives").name
'torch_distribute.collectives'
"""

from __future__ import annotations

import logging
import os
import warnings

ROOT = "torch_distribute"
ENVIRONMENT_VARIABLE = "TD_LOG_LEVEL"


def get_logger(part: str | None = None) -> logging.Logger:
    """``torch_distribute``'s logger, or its child ``torch_distribute.<part>``."""
    return logging.getLogger(ROOT if not part else f"{ROOT}.{part}")


def parse_level(level: int | str) -> int | None:
    """``level`` as a ``logging`` level number, or ``None`` if it is not one.

    >>> parse_level("debug"), parse_level(20), parse_level("LOUD")
    (10, 20, None)
    """
    if isinstance(level, bool):
        return None
    if isinstance(level, int):
        return level if level >= 0 else None
    if isinstance(level, str):
        text = level.strip().upper()
        if text.isdigit():
            return int(text)
        number = logging.getLevelName(text)
        return number if isinstance(number, int) else None
    return None


def set_level(level: int | str) -> None:
    """Set the ``torch_distribute`` logger's level (``td.config.set_log_level`` checks it)."""
    number = parse_level(level)
    if number is None:
        raise ValueError(f"not a logging level: {level!r}")
    get_logger().setLevel(number)


def _level_from_environment() -> None:
    value = os.environ.get(ENVIRONMENT_VARIABLE)
    if not value:
        return
    number = parse_level(value)
    if number is None:
        warnings.warn(f"{ENVIRONMENT_VARIABLE}={value!r} is not a logging level (use DEBUG, INFO, "
                      "WARNING, ERROR or a number); the torch_distribute logger keeps its level.",
                      stacklevel=2)
        return
    get_logger().setLevel(number)


_level_from_environment()
