"""What kind of communication failure an exception is: the one place that reads error text.

Where Python or torch says it with a type, the type decides: ``TimeoutError``,
``ConnectionError`` (refused, reset, aborted, broken pipe), ``torch.distributed.DistError``
(its store, network and backend errors). Gloo's transport and torch's RPC agent raise a plain
``RuntimeError`` whose message is then the only signal (``"... Connection reset by peer"``,
``"... timed out"``), so those messages are matched here, and nowhere else.

>>> failure_kind(TimeoutError("no answer")), failure_kind(ConnectionResetError())
(<FailureKind.TIMED_OUT: 'timed out'>, <FailureKind.CONNECTION_CLOSED: 'connection closed'>)
>>> failure_kind(RuntimeError("[pair.cc:598] Connection closed by peer [10.0.0.2]:4521"))
<FailureKind.CONNECTION_CLOSED: 'connection closed'>
>>> failure_kind(ValueError("bad batch")) is None
True
"""

from __future__ import annotations

import enum
import re

import torch.distributed as dist

# The texts of errors that carry no type of their own (Gloo, the RPC agent).
_CLOSED_TEXT = re.compile(r"Connection (closed|reset) by peer|Broken pipe|ECONNRESET")
_TIMEOUT_WORDS = ("timed out", "timeout")
_COMMUNICATION_WORDS = ("connection", "peer", "socket", "closed")


class FailureKind(enum.Enum):
    """How a call to another process failed."""

    CONNECTION_CLOSED = "connection closed"  # the other side's connection closed: it is gone
    TIMED_OUT = "timed out"  # no answer in time: it may be alive but stalled
    COMMUNICATION = "communication"  # some other failure of the transport


def failure_kind(error: BaseException) -> FailureKind | None:
    """The kind of communication failure ``error`` is, or None for any other error."""
    if isinstance(error, TimeoutError):
        return FailureKind.TIMED_OUT
    if isinstance(error, ConnectionError):
        return FailureKind.CONNECTION_CLOSED
    text = str(error)
    if _CLOSED_TEXT.search(text):
        return FailureKind.CONNECTION_CLOSED
    lowered = text.lower()
    if any(word in lowered for word in _TIMEOUT_WORDS):
        return FailureKind.TIMED_OUT
    if isinstance(error, dist.DistError) or any(word in lowered for word in _COMMUNICATION_WORDS):
        return FailureKind.COMMUNICATION
    return None
