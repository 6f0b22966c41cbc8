"""Loss scaling under ``FullyShardedStrategy``: an overflow in one worker's shard skips the step
on every worker.

Each worker holds only its shard of the gradient, so each checks only its shard for inf/NaN;
the step must still be skipped everywhere, or the workers' shards would drift apart (one
updated, one not) with nothing said. ``tests/multiworker/fs_overflow_job.py`` makes the
gradient overflow in worker 1's shard alone and records, per step and worker, what happened.
Compared with one process without a strategy, which skips the same step.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from torch_distribute.cluster.launcher import free_ports

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mw_helpers as H  # noqa: E402
import proc_helpers as P  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")

JOB = str(Path(__file__).resolve().parent / "multiworker" / "fs_overflow_job.py")
STEPS, OVERFLOW_AT = 4, 2


def _reference() -> list[float]:
    """One process: the same model and data; both workers' batches are the same rows, and the
    gradients are summed over the 2 workers, so the gradient is twice one batch's. The
    overflowing step is skipped."""
    torch.manual_seed(H.CHIEF_SEED)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(7)
    for k in range(STEPS):
        x = torch.randn(2, 4, generator=data)
        if k == OVERFLOW_AT:
            continue
        y = model(x)
        (2 * (y[:, 0].square().mean() + y[:, 1].square().mean())).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [v for p in model.parameters() for v in p.detach().reshape(-1).tolist()]


@pytest.mark.timeout(150)
def test_an_overflow_in_one_shard_skips_the_step_on_every_worker(tmp_path):
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]}
    with P.processes(tmp_path) as procs:
        started = [procs.spawn([JOB, "--steps", str(STEPS), "--overflow-at", str(OVERFLOW_AT)],
                               P.clean_env(MW_RANK=str(rank), TF_CONFIG=json.dumps(
                                   {"cluster": cluster, "task": {"type": "worker", "index": rank}})),
                               f"overflow{rank}")
                   for rank in range(2)]
        reports = H.results_of_clean_exits(procs, started, 120)
    # The overflow is in worker 1's shard only: worker 0 sees finite gradients...
    assert reports[0]["finite_local_grads"][OVERFLOW_AT] is True
    assert reports[1]["finite_local_grads"][OVERFLOW_AT] is False
    expected_changed = [k != OVERFLOW_AT for k in range(STEPS)]
    for rank in range(2):
        # ...and still skips the step, and halves the same scale.
        assert reports[rank]["changed"] == expected_changed, reports[rank]
        assert reports[rank]["scales"] == [2.0**15] * OVERFLOW_AT + [2.0**14] * (STEPS - OVERFLOW_AT), reports[rank]
    assert reports[0]["params"] == reports[1]["params"]
    assert reports[0]["params"] == pytest.approx(_reference(), abs=1e-6)
