"""Each failed worker's record of how it failed, so that a launcher names the *first* failure.

When one worker raises, the others fail after it (their collectives lose a partner), and a
launcher that watches exit codes sees whichever process ended first. A worker that ends
with an error therefore writes, at exit, when and why it failed into the file named by
``TORCHELASTIC_ERROR_FILE`` (set for each worker by ``torchrun`` and by
``torch-distribute launch``), in torchelastic's format (``message.message``,
``message.extraInfo.timestamp``) plus two fields of ours: the time in full precision and
whether the failure was the program's own or the consequence of another worker's
(a ``WorkerUnavailableError``). ``first_failure`` then picks the cause: the earliest failure
of a program, else a worker that died without a record (killed), else the earliest
consequence.

>>> record = FailureRecord(time=1.5, message="ValueError: bad batch", consequence=False)
>>> first_failure([(0, FailureRecord(2.0, "WorkerUnavailableError: ...", True), True), (1, record, True)])
1
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Hashable, Sequence
from typing import NamedTuple

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


class FailureRecord(NamedTuple):
    """When a worker failed (``time.time()``), its error, and whether another worker's
    failure caused it."""

    time: float
    message: str
    consequence: bool


def write(error: BaseException | None, consequence: bool) -> None:
    """Record this process's failure in ``$TORCHELASTIC_ERROR_FILE``, if set and not yet
    written: its first failure is the one that counts (never raises).

    ``error``: the failure, or None (the program caught it and exited itself).
    """
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    now = time.time()
    if error is not None:
        message = f"{type(error).__name__}: {error}"
        stack = "".join(traceback.format_exception(error))
    else:
        message, stack = "the program exited after a failure of another worker was reported", ""
    # torchrun names the failure with the smallest whole-second timestamp, the lowest rank on
    # a tie: a consequence, seldom a second after its cause, is dated a second later.
    content = {"message": {"message": message, "extraInfo": {
        "py_callstack": stack, "timestamp": str(int(now) + int(consequence)),
        "td_time": repr(now), "td_consequence": consequence}}}
    try:
        with open(path, "x") as file:
            json.dump(content, file)
    except OSError:  # FileExistsError included
        pass


def read(path: str) -> FailureRecord | None:
    """The record in ``path`` (ours or torchelastic's), or None if there is none."""
    try:
        with open(path) as file:
            content = json.load(file)
        message = content["message"]
        if isinstance(message, str):
            return FailureRecord(float(content.get("timestamp", 0)), message, False)
        extra = message.get("extraInfo", {})
        when = float(extra.get("td_time", extra.get("timestamp", 0)))
        return FailureRecord(when, str(message.get("message", "")), bool(extra.get("td_consequence", False)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def first_failure(failures: Sequence[tuple[Hashable, FailureRecord | None, bool]]) -> Hashable:
    """The key of the failure that came first, among ``(key, record, ended_by_itself)`` in
    the order the failures were seen. A worker with no record counts only if it ended by
    itself (not stopped by the launcher): it died without Python's exit (a signal, a crash)."""
    own = [(r.time, k) for k, r, _ in failures if r is not None and not r.consequence]
    if own:
        return min(own, key=lambda item: item[0])[1]
    silent = [k for k, r, by_itself in failures if r is None and by_itself]
    if silent:
        return silent[0]
    caused = [(r.time, k) for k, r, _ in failures if r is not None]
    if caused:
        return min(caused, key=lambda item: item[0])[1]
    return failures[0][0]
