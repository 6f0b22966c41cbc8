"""Gradient accumulation across workers: two backward passes per optimizer step."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
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


@pytest.mark.timeout(120)
def test_under_torchrun():
    """torchrun's own agent store and environment: the same result as our launcher."""
    env = dict(os.environ, PYTHONPATH=WORKERS + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    env.pop("TF_CONFIG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--tee", "1",
         os.path.join(WORKERS, "accumulate.py"), "--zero-grad", "none"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=100)
    finally:  # torchrun and its workers share a process group: never leave any behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-3000:]
    results = [json.loads(line[line.index("{"):]) for line in stdout.splitlines() if "{" in line]
    assert len(results) == 2 and results[0] == results[1]
    torch.testing.assert_close(torch.tensor(results[0]["params"]), reference_params(), rtol=1e-5, atol=1e-6)
