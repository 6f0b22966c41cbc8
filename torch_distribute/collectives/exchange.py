"""What one fingerprint exchange carries, packed and read with ``struct``.

Before (or instead of) every collective on the main group, the workers all-gather one row
each: the collective's fingerprint (``fingerprint.HEAD`` int64s) and a payload of at most
``PAYLOAD_BYTES`` (a flag, a size, the values of a small reduction). Every row has the same
size, whatever it carries, so two workers in different exchanges find different
fingerprints instead of making Gloo abort on a size mismatch.

Rows are made and read in plain Python: a small tensor operation costs several
microseconds, a ``struct`` call well under one, and the exchange runs at least twice per
training step. The common small reduction (a SUM of float16/32/64 values: a loss, a metric's
totals) is combined in Python too, in rank order, rounded to the tensor's dtype after every
addition. That is the tensor addition bit for bit: a double carries more than twice a
float32's (or float16's) precision plus two bits, so adding in double and then rounding gives
the correctly rounded sum.

>>> row = pack(b"\\x00" * HEAD_BYTES, small_values(torch.tensor([1.5])))
>>> rows(row.view(1, WIDTH))[0][1][:8] == struct.pack("<d", 1.5)
True
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torch_distribute.collectives import fingerprint

HEAD_BYTES = fingerprint.HEAD * 8
PAYLOAD_BYTES = 64  # at most 8 values of 8 bytes each
WIDTH = (HEAD_BYTES + PAYLOAD_BYTES) // 8  # int64s in a row
SMALL = PAYLOAD_BYTES // 8  # elements: a reduction this small rides in its exchange

_PADDING = [b"\x00" * (PAYLOAD_BYTES - n) for n in range(PAYLOAD_BYTES + 1)]
# Floating dtypes a Python float can be rounded to with struct (bfloat16 cannot).
_ROUNDING_FORMATS = {torch.float64: "d", torch.float32: "f", torch.float16: "e"}
_COMBINE: dict[Any, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    dist.ReduceOp.SUM: torch.add,
    dist.ReduceOp.PRODUCT: torch.mul,
    dist.ReduceOp.MAX: torch.maximum,
    dist.ReduceOp.MIN: torch.minimum,
}


def pack(head: bytes, payload: bytes = b"") -> torch.Tensor:
    """One worker's row: ``head`` (a fingerprint) then ``payload``, zero-padded."""
    return torch.frombuffer(bytearray(head + payload + _PADDING[len(payload)]), dtype=torch.int64)


def rows(gathered: torch.Tensor) -> list[tuple[bytes, bytes]]:
    """Every worker's (fingerprint, payload of ``PAYLOAD_BYTES``), in rank order: the
    gathered buffer is read once."""
    data = gathered.numpy().tobytes()
    row = WIDTH * 8
    return [(data[start:start + HEAD_BYTES], data[start + HEAD_BYTES:start + row])
            for start in range(0, len(data), row)]


def can_carry(tensor: torch.Tensor, op: Any) -> bool:
    """Whether a reduction of ``tensor`` by ``op`` can travel inside its exchange."""
    return (op in _COMBINE and tensor.numel() <= SMALL and not tensor.dtype.is_complex
            and tensor.dtype is not torch.uint64)


def small_values(tensor: torch.Tensor) -> bytes:
    """``tensor``'s values as a payload: float64s for floating dtypes, int64s otherwise
    (both exact for every dtype ``can_carry`` accepts)."""
    values = tensor.detach().reshape(-1).tolist()
    if tensor.is_floating_point():
        return struct.pack(f"<{len(values)}d", *values)
    return struct.pack(f"<{len(values)}q", *map(int, values))


def combine(payloads: list[bytes], op: Any, like: torch.Tensor) -> torch.Tensor:
    """The reduction by ``op``, in rank order, of every worker's ``small_values`` of a tensor
    like ``like``: a tensor of its dtype, shape and device."""
    count = like.numel()
    rounding = _ROUNDING_FORMATS.get(like.dtype)
    if op == dist.ReduceOp.SUM and rounding is not None:
        parts = [struct.unpack(f"<{count}d", payload[:8 * count]) for payload in payloads]
        totals = list(parts[0])
        for part in parts[1:]:
            totals = [_rounded(total + value, rounding) for total, value in zip(totals, part, strict=True)]
        return torch.tensor(totals, dtype=like.dtype).view(like.shape).to(like.device)
    # Other dtypes and operations: tensor arithmetic, with its rounding and NaN rules.
    values = torch.frombuffer(bytearray(b"".join(payload[:8 * count] for payload in payloads)), dtype=torch.int64)
    values = values.view(len(payloads), count)
    if like.is_floating_point():
        values = values.view(torch.float64)
    rows = values.to(device=like.device, dtype=like.dtype)
    total = rows[0]
    for row in rows[1:]:
        total = _COMBINE[op](total, row)
    return total.view(like.shape)


def _rounded(value: float, rounding: str) -> float:
    """``value`` rounded to the nearest number of the format (``inf`` past its largest)."""
    if rounding == "d":
        return value
    try:
        return struct.unpack(f"<{rounding}", struct.pack(f"<{rounding}", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)
