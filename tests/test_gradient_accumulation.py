"""Gradient accumulation across workers: two backward passes per optimizer step."""

from __future__ import annotations

import io
import json
import os
import sys

import pytest
import torch

from torch_distribute.cluster.launcher import launch

WORKERS = os.path.join(os.path.dirname(__file__), "workers")
sys.path.insert(0, WORKERS)

from accumulate_reference import reference_params  # noqa: E402


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero_grad", ["none", "zeros"])
def test_accumulated_gradients_are_summed_once_across_workers(zero_grad):
    out, err = io.StringIO(), io.StringIO()
    code = launch([os.path.join(WORKERS, "accumulate.py"), "--zero-grad", zero_grad], nproc=2,
                  timeout=100, grace_period=2, stdout=out, stderr=err,
                  extra_env={"PYTHONPATH": WORKERS + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert code == 0, err.getvalue()[-3000:]
    results = [json.loads(line.split("] ", 1)[1]) for line in out.getvalue().splitlines() if "{" in line]
    assert len(results) == 2 and results[0] == results[1]
    torch.testing.assert_close(torch.tensor(results[0]["params"]), reference_params(), rtol=1e-5, atol=1e-6)
