"""Collective fingerprints: what a worker is about to call, comparable across workers.

A collective that pairs different calls on different workers (a ``reduce`` on one, the
next step's input agreement on another; tensors of one shape on one worker and another
shape with as many elements on the other) either aborts inside Gloo or NCCL or, worse,
returns numbers that mix unrelated tensors. So before each collective the workers exchange
a fingerprint of it (its kind, purpose, dtype and shape: ``encode``) and raise
``ReplicaMismatchError`` on every worker if they differ.

Gradient buckets are launched asynchronously while backward runs, so they carry their
fingerprint inside the bucket instead: ``SIGNATURE_LENGTH`` extra elements of +1 or -1,
the bits of a hash of (optimizer step number, ``run`` number). After the SUM every element
is ``±world_size`` exactly when every worker wrote the same signs (exact in every float
dtype for up to 256 workers).

>>> encode("reduce", "reduce", torch.float32, (4,)) == encode("reduce", "reduce", torch.float32, (2, 2))
False
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import struct
from collections.abc import Sequence

import torch

SIGNATURE_LENGTH = 32
HEAD = 3  # int64s in a fingerprint (encode)

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _digest(text: str) -> int:
    """A 63-bit hash that is the same in every process (``hash()`` of a str is not)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def describe(what: str, dtype: torch.dtype | None, shape: Sequence[int] | None) -> str:
    """``"reduce of float32[2, 3]"``: a collective as the error message names it."""
    if dtype is None:
        return what
    dims = ", ".join(map(str, shape or ()))
    return f"{what} of {str(dtype).removeprefix('torch.')}[{dims}]"


def encode(kind: str, what: str, dtype: torch.dtype | None, shape: Sequence[int] | None) -> bytes:
    """The fingerprint of one collective: ``HEAD`` little-endian int64s (63 bits each), equal
    on workers calling the same."""
    return _encode(kind, what, dtype, tuple(shape) if shape is not None else None)


@functools.lru_cache(maxsize=4096)
def _encode(kind: str, what: str, dtype: torch.dtype | None, shape: tuple[int, ...] | None) -> bytes:
    return struct.pack("<3q", _digest(f"{kind}|{what}"), _digest(str(dtype)), _digest(repr(shape or ())))


@functools.lru_cache(maxsize=8)  # asked for by every bucket of a step
def signature(step: int, run: int) -> tuple[float, ...]:
    """The ±1 signs a gradient bucket carries for optimizer step ``step`` in run ``run``."""
    bits = _digest(f"gradients|{step}|{run}")
    return tuple(1.0 if bits >> i & 1 else -1.0 for i in range(SIGNATURE_LENGTH))


def call_site() -> str:
    """``"train.py:41 in train_step"``: the innermost frame outside this package and torch."""
    frame = inspect.currentframe()
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith((_PACKAGE_DIR, _TORCH_DIR)) and not filename.startswith("<frozen"):
            return f"{os.path.basename(filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "an unknown place"
