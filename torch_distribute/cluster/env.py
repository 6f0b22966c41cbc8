"""Reading a resolver's environment variables, with errors that name the variable.

Shared by every resolver: each reads from a mapping (``os.environ`` by default, a plain
dict in tests) and reports a missing or malformed variable as a ``ClusterConfigError``.

>>> env = {"RANK": "1", "WORLD_SIZE": "x", "SLURM_JOB_NODELIST": "n[1-2]"}
>>> env_int(env, "RANK", minimum=0), env_int(env, "LOCAL_RANK", default=0)
(1, 0)
>>> env_int(env, "WORLD_SIZE")
Traceback (most recent call last):
...
torch_distribute.errors.ClusterConfigError: WORLD_SIZE='x' is not an integer
>>> first_env(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
('SLURM_JOB_NODELIST', 'n[1-2]')
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from torch_distribute.errors import ClusterConfigError

__all__ = ["env_int", "env_int_value", "environ_or_default", "first_env", "seen_variables"]


def environ_or_default(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    """``environ``, or ``os.environ`` when it is ``None``."""
    return os.environ if environ is None else environ


def first_env(environ: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """``(name, value)`` of the first of ``names`` that is set and non-empty.

    >>> first_env({"A": " ", "B": "x"}, "A", "B")
    ('B', 'x')
    """
    for name in names:
        value = environ.get(name)
        if value is not None and value.strip():
            return name, value.strip()
    return None


def env_int_value(name: str, value: str) -> int:
    """``value`` (of the variable ``name``) as an int; a ``ClusterConfigError`` naming it."""
    try:
        return int(value.strip())
    except ValueError:
        raise ClusterConfigError(f"{name}={value!r} is not an integer") from None


def env_int(
    environ: Mapping[str, str],
    name: str,
    *,
    default: int | None = None,
    minimum: int | None = None,
    maximum: int | None = None,
    hint: str = "",
) -> int:
    """The variable ``name`` as an int, with a default when unset and bounds to check.

    >>> env_int({"RANK": " 3 "}, "RANK", minimum=0)
    3
    """
    value = environ.get(name)
    if value is None or not value.strip():
        if default is not None:
            return default
        raise ClusterConfigError(f"environment variable {name} is not set{hint}")
    number = env_int_value(name, value)
    if minimum is not None and number < minimum:
        raise ClusterConfigError(f"{name}={value!r} is below {minimum}")
    if maximum is not None and number > maximum:
        raise ClusterConfigError(f"{name}={value!r} is above {maximum}")
    return number


def seen_variables(environ: Mapping[str, str], names: tuple[str, ...] | list[str]) -> str:
    """``NAME='value'`` for each of ``names`` that is set, for error messages.

    >>> seen_variables({"RANK": "1", "X": "2"}, ("RANK", "WORLD_SIZE"))
    "RANK='1'"
    """
    shown = [f"{name}={environ[name]!r}" for name in names if name in environ]
    return ", ".join(shown) if shown else "none of them"
