"""Each replica of a served Keras model's forward draws random numbers of its own.

One device draws a different dropout mask for every row of a batch. When the global batch is
cut over replicas, each replica must draw its own numbers too, else replica 1's rows get the
mask pattern replica 0's rows got (a correlation no one-device run has). Keras draws from two
places, and each gets one rule:

- **Keras' seed generators** (``keras.random.SeedGenerator``: a layer given a ``seed``, such
  as ``Dropout(0.5, seed=1)``, ``GaussianNoise``, the random augmentation layers). Its state
  is ``[seed, counter]``; every replica's forward runs in a ``keras.StatelessScope`` that
  starts from the same state. Replica ``r`` (its ``replica_id_in_sync_group``) draws with the
  seed moved by ``seed_offset(r)`` (a 32-bit mix of ``r``; replica 0's is 0, so it draws what
  one device draws for its first rows), and the state kept afterwards is the generator's own,
  advanced as one device advances it (``without_offset``).
- **torch's default generator** (Keras' ``Dropout`` without a seed calls torch's dropout). CPU
  replica threads of one process already draw from generators of their own
  (``strategies/replica_rng.py``: ``replica_seed(base, r)``, ``base`` drawn from the process's
  generator at the step's first draw). A CPU replica computed on the calling thread (one per
  worker under ``MultiWorkerMirroredStrategy``, whose workers share a seed so that they read
  the same batches) gets the same ``ReplicaRandomMode``. A GPU replica draws, during its
  forward, from its device's generator reseeded with ``replica_seed(base, r)``, ``base`` read
  from that generator's seed and offset (the same on every worker); afterwards the generator
  is put back and, if the forward drew from it, advanced by one draw. Either way the next step
  draws other numbers, and a model that draws nothing leaves the generators untouched (a
  shuffle reading them stays one device's).

So the replicas' masks are independent, as one device's rows are; a model with dropout trains
as one device does in distribution, not bitwise (no data-parallel run reproduces one device's
masks).

>>> seed_offset(0), seed_offset(1) != seed_offset(2)
(0, True)
>>> state = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8)  # seed, offset
>>> _base(state) != _base(state.roll(8))
True
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from torch_distribute.strategies.replica_rng import (
    ReplicaRandomMode,
    RunSeed,
    in_replica_stream,
    replica_seed,
)

#: The name Keras gives a ``SeedGenerator``'s state variable (``keras_seams.KERAS_TARGETS``).
SEED_STATE_NAME = "seed_generator_state"

_MASK64 = (1 << 64) - 1
_OFFSET_BASE = 0x6B657261  # any constant: the offsets only need to differ between replicas
_device_locks: dict[str, threading.Lock] = {}
_locks_lock = threading.Lock()


def seed_offset(replica_id: int) -> int:
    """What replica ``replica_id`` adds to a Keras seed generator's seed (as int32: Keras'
    torch seed dtype); 0 for replica 0."""
    if replica_id == 0:
        return 0
    unsigned = replica_seed(_OFFSET_BASE, replica_id) & 0xFFFFFFFF
    return unsigned - (1 << 32) if unsigned >= 1 << 31 else unsigned


def is_seed_state(variable: Any) -> bool:
    """Whether a Keras variable is a ``SeedGenerator``'s ``[seed, counter]`` state."""
    return (getattr(variable, "name", None) == SEED_STATE_NAME and not getattr(variable, "trainable", True)
            and tuple(getattr(variable, "shape", ())) == (2,))


def with_offset(value: torch.Tensor, replica_id: int) -> torch.Tensor:
    """A seed state ``[seed, counter]`` as replica ``replica_id`` draws from it."""
    return value + _offset_tensor(value, replica_id)


def without_offset(value: torch.Tensor, replica_id: int) -> torch.Tensor:
    """The inverse of ``with_offset``: the generator's own state, advanced as the replica
    advanced it."""
    return value - _offset_tensor(value, replica_id)


def _offset_tensor(value: torch.Tensor, replica_id: int) -> torch.Tensor:
    return torch.tensor([seed_offset(replica_id), 0], dtype=value.dtype, device=value.device)


def seeded_mapping(states: Sequence[Any], replica_id: int) -> list[tuple[Any, torch.Tensor]]:
    """``keras.StatelessScope``'s ``state_mapping`` for replica ``replica_id``: each seed state
    in ``states`` with the replica's offset (nothing for replica 0: one device's stream)."""
    if replica_id == 0:
        return []
    return [(v, with_offset(v.value, replica_id)) for v in states if is_seed_state(v)]


@contextlib.contextmanager
def own_torch_stream(device: torch.device, replica_id: int) -> Iterator[None]:
    """While the block runs, torch's generator for ``device`` draws replica ``replica_id``'s
    numbers (see the module's rule); nothing where the replica already has a stream of its own."""
    if in_replica_stream() or device.type not in ("cpu", "cuda"):
        yield
        return
    if device.type == "cpu":
        # The CPU replica threads' own mode: each sampling call swaps the process's generator
        # for the replica's under one lock, so no other thread ever draws the replica's numbers.
        with ReplicaRandomMode(RunSeed(), replica_id):
            yield
        return
    generator = _cuda_generator(device)
    with _lock_for(device):
        saved = generator.get_state()
        generator.manual_seed(replica_seed(_base(saved), replica_id))
        start = generator.get_state()
        try:
            yield
        finally:
            drew = not torch.equal(generator.get_state(), start)
            generator.set_state(saved)
            if drew:  # the next step's base differs, as one device's stream moves on
                torch.empty((), dtype=torch.int64, device=device).random_(generator=generator)


def _base(state: torch.Tensor) -> int:
    """One 64-bit number read from a CUDA generator's state (its seed and offset), on the host:
    the same state gives the same number."""
    value, mixed = int.from_bytes(bytes(state.tolist()), "little"), 0
    while value:
        mixed = replica_seed(mixed ^ (value & _MASK64), 0)
        value >>= 64
    return mixed


def _cuda_generator(device: torch.device) -> torch.Generator:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.default_generators[index]


def _lock_for(device: torch.device) -> threading.Lock:
    """Replicas sharing a device (logical GPUs) take turns with its generator."""
    key = str(device)
    with _locks_lock:
        return _device_locks.setdefault(key, threading.Lock())
