"""Workers with different amounts of data stop together, under every sharding policy.

Two real worker processes (``tests/multiworker/uneven_job.py``, started by the launcher)
have 20 and 17 batches: under ``AutoShardPolicy.DATA`` (a sized list of global batches) and
``distribute_datasets_from_function`` both must run 20 steps, under ``AutoShardPolicy.OFF``
(each global batch makes two steps) 40 (the one that ran out trains on empty batches, as
TensorFlow's partial-batch handling does),
end with bitwise equal parameters, and match one process training on the rows that exist
at each step. The dataset-side tests need no processes: the agreement runs at every step,
sized dataset or not.
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest
import torch

import torch_distribute as td
from torch_distribute.cluster.launcher import launch
from torch_distribute.input import DatasetFromFunction, DistributedDataset
from torch_distribute.input.step_agreement import StepReport

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "multiworker"))
import mw_helpers as H  # noqa: E402
import uneven_job as J  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")

WORKER = str(HERE / "multiworker" / "uneven_job.py")
CPU2 = [torch.device("cpu")] * 2


# -- the dataset side: the agreement is asked at every step ----------------------------------


class Recorder:
    """A stand-in for ``extended.gather_input_reports``: records whether this worker had data
    and replies with its report and another worker's, which has data as scripted (default:
    as this one)."""

    def __init__(self, other_has_data: list[bool] | None = None):
        self.asked: list[bool] = []
        self._other = iter(other_has_data) if other_has_data is not None else None

    def __call__(self, report: StepReport) -> list[StepReport]:
        self.asked.append(report.has_data)
        other = report.has_data if self._other is None else next(self._other)
        return [report, StepReport(other, 0, 0)]


@pytest.mark.parametrize("policy", list(td.AutoShardPolicy))
def test_every_policy_agrees_at_every_step_even_for_a_sized_dataset(policy):
    class Shardable(list):
        def shard(self, num_shards: int, index: int) -> Shardable:
            return self

    sync = Recorder()
    dataset = DistributedDataset(Shardable([torch.arange(8.0)] * 3), CPU2, num_workers=2, worker_index=0,
                                 options=td.InputOptions(auto_shard_policy=policy), sync_step=sync)
    steps = 3 if dataset.shard_policy is td.AutoShardPolicy.DATA else 6  # OFF, FILE: 2 steps a batch
    assert len(list(dataset)) == steps == len(dataset)
    assert sync.asked == [True] * steps + [False]


def test_data_policy_worker_that_ran_out_gets_empty_batches_until_all_have():
    # This worker (1 of 2) has 2 global batches; another worker still has a third.
    sync = Recorder([True, True, True, False])
    dataset = DistributedDataset([torch.arange(8.0).reshape(4, 2)] * 2, CPU2, num_workers=2, worker_index=1,
                                 sync_step=sync)
    steps = list(dataset)
    assert len(steps) == 3 and sync.asked == [True, True, False, False]
    assert [v.shape for v in steps[2].values] == [(0, 2), (0, 2)]
    assert [v.shape for v in steps[0].values] == [(1, 2), (1, 2)]  # rows 2 and 3 of 4 (pieces 2 and 3)


def test_from_function_agrees_at_every_step():
    sync = Recorder([True, True, False])
    dataset = DatasetFromFunction([torch.ones(2, 3)] * 2, CPU2, sync_step=sync)
    steps = list(dataset)
    assert len(steps) == 2 and sync.asked == [True, False, False]
    assert [v.shape for v in steps[1].values] == [(0, 3), (0, 3)]


# -- two worker processes ------------------------------------------------------------------


def _run(mode: str, counts: str, *extra: str) -> dict[int, dict]:
    out, err = io.StringIO(), io.StringIO()
    code = launch([WORKER, mode, counts, "--timeout", "30", *extra], 2, env_mode="torchrun", grace_period=2,
                  timeout=150, extra_env={"OMP_NUM_THREADS": "1"}, stdout=out, stderr=err)
    assert code == 0, (out.getvalue()[-4000:], err.getvalue()[-3000:])
    results = H.parse_results(out.getvalue())
    assert sorted(results) == [0, 1], out.getvalue()[-3000:]
    return results


def _reference(mode: str, counts: list[int]) -> list[float]:
    """One process, no strategy: each step trains on the rows the workers still have."""
    model = J.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=J.LR)
    half = J.GLOBAL_BATCH // 2
    per_batch = 2 if mode == "off" else 1  # OFF: each worker's global batch makes two steps
    for step in range(max(counts) * per_batch):
        pieces = []
        for worker, count in enumerate(counts):
            if step >= count * per_batch:
                continue
            if mode == "off":  # each worker's own global batch, half of it a step
                x, y = J.batches(step // 2 + 1)[step // 2]
                rows = slice((step % 2) * half, (step % 2 + 1) * half)
            else:  # DATA keeps, and the dataset function gives, this worker's half
                x, y = J.batches(step + 1)[step]
                rows = slice(worker * half, (worker + 1) * half)
            pieces.append((x[rows], y[rows]))
        x = torch.cat([p[0] for p in pieces])
        y = torch.cat([p[1] for p in pieces])
        J.loss_of(model, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return H.flat(model)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("mode", "counts"),
    [("data", "20,17"), ("function", "17,20"), ("off", "20,17")],
    ids=["data-worker1-short", "function-chief-short", "off-worker1-short"],
)
def test_two_workers_with_20_and_17_batches_stop_together(mode, counts):
    results = _run(mode, counts)
    numbers = [int(c) for c in counts.split(",")]
    short = numbers.index(min(numbers))
    per_batch = 2 if mode == "off" else 1
    longest, fewest = max(numbers) * per_batch, min(numbers) * per_batch
    for rank in (0, 1):
        assert results[rank]["steps"] == longest, results[rank]
        assert results[rank]["global_rows"] == [8] * fewest + [4] * (longest - fewest)
    # The worker that ran out trained on empty batches until the other one was done.
    assert results[short]["local_rows"] == [4] * fewest + [0] * (longest - fewest)
    assert results[1 - short]["local_rows"] == [4] * longest
    assert results[0]["params"] == results[1]["params"]  # bitwise
    expected = _reference(mode, numbers)
    assert max(abs(a - b) for a, b in zip(results[0]["params"], expected, strict=True)) < 1e-5
