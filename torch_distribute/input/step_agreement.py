"""What the workers tell each other at every step of a distributed dataset, and what follows.

At every step each worker reports whether it still has data, how many rows its replicas'
batches hold and, under ``AutoShardPolicy.DATA`` during the first steps of an iteration, a
digest of the global batch it read: one small collective (``extended.gather_input_reports``),
the one the workers need anyway to stop together. From the reports every worker concludes the
same thing at the same step:

- no worker has data: the iteration ends (``StopIteration``) on every worker;
- at the first step some workers have no data at all (a FILE shard without files, an empty
  dataset): ``DatasetError`` on every worker, naming them (TensorFlow raises on every worker
  too);
- under DATA, the workers read different global batches (their loaders shuffle with
  different seeds, a DDP habit): ``DatasetError`` on every worker, with the fix, instead of
  an epoch in which some examples are trained twice and others never;
- otherwise the step's global rows: the sum of every worker's rows, which
  ``compute_average_loss`` compares with ``global_batch_size``.

>>> report = StepReport(True, 4, 0)
>>> StepReport.unpack(report.pack() + bytes(40)) == report
True
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torch_distribute import nest
from torch_distribute.errors import DatasetError
from torch_distribute.input.input_context import AutoShardPolicy

_FORMAT = "<?qq"
#: The first steps of every iteration whose global batches DATA workers compare.
DIGESTED_STEPS = 2
#: At most this many elements of each tensor go into a batch's digest (spread over it).
_DIGEST_ELEMENTS = 4096


@dataclass(frozen=True)
class StepReport:
    """One worker's report at one step: data or not, its replicas' rows, a batch digest (0: none)."""

    has_data: bool
    rows: int
    digest: int

    def pack(self) -> bytes:
        return struct.pack(_FORMAT, self.has_data, self.rows, self.digest)

    @classmethod
    def unpack(cls, payload: bytes) -> StepReport:
        has_data, rows, digest = struct.unpack_from(_FORMAT, payload)
        return cls(bool(has_data), rows, digest)


def batch_digest(batch: Any) -> int:
    """A digest of a batch's shapes, dtypes and values, from at most 4096 elements of each
    tensor spread over it (rows shuffled differently give different digests; reading them
    all would cost a copy of the batch). Never 0.

    >>> batch_digest(torch.arange(8)) == batch_digest(torch.arange(8)), batch_digest(torch.arange(8)) == batch_digest(torch.arange(8).flip(0))
    (True, False)
    """
    hasher = hashlib.blake2b(digest_size=8)
    for leaf in nest.leaves(batch):
        flat = leaf.detach().reshape(-1)
        stride = max(1, flat.numel() // _DIGEST_ELEMENTS)
        sample = flat[::stride][:_DIGEST_ELEMENTS].cpu().contiguous()
        hasher.update(f"{tuple(leaf.shape)} {leaf.dtype};".encode())
        hasher.update(sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b"")
    return int.from_bytes(hasher.digest(), "little", signed=True) or 1


def conclude(reports: Sequence[StepReport], step: int, policy: AutoShardPolicy | None) -> int | None:
    """What every worker concludes from every worker's report at ``step`` (0 the first):
    ``None`` at the end of the data, else the step's global rows; raises ``DatasetError`` on
    every worker for the mistakes in the module's docstring."""
    with_data = [k for k, report in enumerate(reports) if report.has_data]
    if not with_data:
        return None
    if step == 0 and len(with_data) < len(reports):
        without = [k for k in range(len(reports)) if k not in with_data]
        raise DatasetError(_no_data_at_first_step(without, len(reports), policy))
    digests = {reports[k].digest for k in with_data if reports[k].digest}
    if len(digests) > 1:
        raise DatasetError(_different_batches(step))
    return sum(report.rows for report in reports)


def _no_data_at_first_step(without: list[int], workers: int, policy: AutoShardPolicy | None) -> str:
    names = ", ".join(f"worker {k}" for k in without)
    if policy is AutoShardPolicy.FILE:
        return (
            f"AutoShardPolicy.FILE gave {names} no data at all: the dataset has fewer files than the "
            f"{workers} workers (or those files are empty), and every worker needs data for each step. "
            "Use AutoShardPolicy.DATA (every worker reads all files and keeps its rows of each global "
            "batch), or split the data into at least as many files as there are workers."
        )
    return (
        f"The dataset of {names} produced no batch at all while the other workers have data; every "
        "worker needs at least one batch to take part in their steps. Check each worker's dataset "
        "(its files, its shard, a filter that removed everything)."
    )


def _different_batches(step: int) -> str:
    return (
        f"Under AutoShardPolicy.DATA every worker must read the same global batches and keep its "
        f"rows of each, but at step {step} of this epoch the workers read different global batches: "
        "their data loaders shuffle in different orders (a DataLoader(shuffle=True) without a "
        "generator, or one seeded with the worker's rank), so some examples would be trained twice "
        "in an epoch and others never. Give every worker's loader the same seed: "
        "DataLoader(dataset, batch_size=GLOBAL_BATCH_SIZE, shuffle=True, "
        "generator=torch.Generator().manual_seed(SEED)) with one SEED for all workers (a new "
        "order every epoch still comes from the generator), or shard per worker yourself with "
        "strategy.distribute_datasets_from_function."
    )
