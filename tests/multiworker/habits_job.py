"""One worker of a job trained the way a DDP user writes it; prints one ``MWRESULT``.

    python habits_job.py [--sharded]

Two worker processes, one CPU replica each (``MultiWorkerMirroredStrategy``, or
``FullyShardedStrategy`` with ``--sharded``), global batches of 8 rows:

1. ``mean``: a step with ``F.cross_entropy(logits, y)`` (reduction="mean"): must raise
   ``td.LossScalingError`` before any update (the parameters are reported);
2. ``correct``: ``td.compute_average_loss`` over the global batch, on every batch;
3. ``opt_out``: ``strategy.set_loss_scaling_check(False)``, then the mean-reduced step once;
4. (not ``--sharded``) a fresh model trained on 4 batches, one NaN in worker 1's rows of the
   third: the warnings are reported; then with ``td.config.set_nonfinite_check("raise")``,
   the error (and whether the parameters stayed finite).

The parameters after each phase are reported (under ``--sharded``, only this worker's shards),
and the ``torch_distribute`` log records (level DEBUG, through a handler the job adds).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mw_helpers as H  # noqa: E402

import torch_distribute as td  # noqa: E402

GLOBAL_BATCH = 8

parser = argparse.ArgumentParser()
parser.add_argument("--sharded", action="store_true")
args = parser.parse_args()

torch.set_num_threads(1)


def habit_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two global batches of 8 rows (the test builds the same)."""
    generator = torch.Generator().manual_seed(11)
    return [(torch.randn(GLOBAL_BATCH, 4, generator=generator), torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator))
            for _ in range(2)]


def params(model: torch.nn.Module) -> list[float]:
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return [v for p in local for v in p.detach().reshape(-1).tolist()]


def nan_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Four global batches; row 6 of the third (worker 1's rows are 4..7) holds a NaN."""
    generator = torch.Generator().manual_seed(12)
    data = [(torch.randn(GLOBAL_BATCH, 4, generator=generator), torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator))
            for _ in range(4)]
    data[2][0][6, 1] = float("nan")
    return data


def nonfinite_phase(strategy: td.Strategy, global_batch: int) -> dict:
    out: dict = {}
    for mode in ("warn", "raise"):
        td.config.set_nonfinite_check(mode)
        with strategy.scope():
            model = torch.nn.Linear(4, 3)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

        def step(x: torch.Tensor, y: torch.Tensor, model=model, optimizer=optimizer) -> None:
            per_example = F.cross_entropy(model(x), y, reduction="none")
            td.compute_average_loss(per_example, global_batch_size=global_batch).backward()
            optimizer.step()
            optimizer.zero_grad()

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                for batch in strategy.experimental_distribute_dataset(nan_data()):
                    strategy.run(step, args=batch)
                out[f"{mode}_error"] = None
            except td.NonFiniteError as error:
                out[f"{mode}_error"] = str(error)
        out[f"{mode}_warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        out[f"{mode}_params_finite"] = all(bool(p.isfinite().all()) for p in model.parameters())
    td.config.set_nonfinite_check("warn")
    return out


class _Records(logging.Handler):
    """What a user's handler on the ``torch_distribute`` logger receives."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


if __name__ == "__main__":
    records = _Records()
    logging.getLogger("torch_distribute").addHandler(records)
    td.config.set_log_level("DEBUG")
    options = td.CommunicationOptions(timeout_seconds=30)
    if args.sharded:
        strategy = td.FullyShardedStrategy(communication_options=options)
    else:
        strategy = td.MultiWorkerMirroredStrategy(devices=["cpu:0"], communication_options=options)
    rank = strategy.cluster_resolver.worker_index
    torch.manual_seed(H.CHIEF_SEED)
    with strategy.scope():
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    result: dict = {"rank": rank, "init": params(model)}

    def ddp_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)  # DDP's habit: the mean over this replica's rows
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def td_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = F.cross_entropy(model(x), y, reduction="none")
        loss = td.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    batches = list(strategy.experimental_distribute_dataset(habit_data()))
    try:
        strategy.run(ddp_step, args=batches[0])
        result["mean_error"] = None
    except td.LossScalingError as error:
        result["mean_error"] = str(error)
    result["after_mean"] = params(model)
    for batch in batches:
        strategy.run(td_step, args=batch)
    result["after_correct"] = params(model)
    strategy.set_loss_scaling_check(False)
    strategy.run(ddp_step, args=batches[0])
    result["after_opt_out"] = params(model)
    if not args.sharded:
        result.update(nonfinite_phase(strategy, GLOBAL_BATCH))
    result["log"] = records.lines
    H.emit(result)
