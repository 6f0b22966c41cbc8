"""The random state of a process, as plain values: saved, sent to another worker and restored.

Torch's default generators (CPU and CUDA), NumPy's and Python's global ones, and any
``torch.Generator`` that decides the data (``find_generators``: those of a ``DataLoader``
and its sampler, also under a distributed dataset). ``BackupAndRestore`` writes these into
its backups; a fault-tolerant strategy sends them to a worker that joins a running job.

>>> import torch
>>> state = capture_rng([])
>>> a = torch.rand(1)
>>> restore_rng(state, [])
>>> bool(torch.rand(1) == a)
True
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "find_generators", "restore_rng"]


def find_generators(iterable: object) -> list[torch.Generator]:
    """Generators that decide a DataLoader's order, also under a distributed dataset (whose
    ``source`` is the loader, possibly wrapped again in a ``source``)."""
    found: list[torch.Generator] = []
    loader = iterable
    for _ in range(3):  # a distributed dataset, a fault-tolerant source, the loader
        inner = getattr(loader, "source", None)
        if inner is None or inner is loader:
            break
        loader = inner
    for holder in (loader, getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        generator = getattr(holder, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def capture_rng(generators: list[torch.Generator]) -> dict[str, Any]:
    """Every global random state, and ``generators``' (tensors and plain values only)."""
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # the global RandomState is MT19937: legacy=True gives a tuple
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np_state
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [np_name, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss, np_gauss],
        "python": [py_version, list(py_state), py_gauss],
        "generators": [g.get_state() for g in generators],
    }


def restore_rng(state: dict[str, Any], generators: list[torch.Generator]) -> None:
    """Put back what ``capture_rng`` gave (``generators`` in the same order)."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, py_state, py_gauss = state["python"]
    random.setstate((version, tuple(py_state), py_gauss))
    for generator, generator_state in zip(generators, state["generators"], strict=False):
        generator.set_state(generator_state)
