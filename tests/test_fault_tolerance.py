"""BackupAndRestore: a run killed or preempted and restarted ends like an uninterrupted one."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch

import torch_distribute as td
from torch_distribute.cluster.launcher import launch

WORKER = os.path.join(os.path.dirname(__file__), "workers", "ft_train.py")
pytestmark = pytest.mark.timeout(180)


def _results(text: str) -> dict[int, dict]:
    """The JSON result line of every rank in launcher (or plain) output."""
    out = {}
    for line in text.splitlines():
        payload = line.split("] ", 1)[1] if line.startswith("[rank ") else line
        if payload.startswith("{"):
            result = json.loads(payload)
            out[result["rank"]] = result
    return out


def _run_single(backup_dir, *extra, attempt=0):
    env = dict(os.environ, TD_RESTART_COUNT=str(attempt))
    env.pop("TF_CONFIG", None)
    return subprocess.run([sys.executable, WORKER, "--backup-dir", str(backup_dir), *extra],
                          capture_output=True, text=True, env=env, timeout=120)


def _launch(backup_dir, *extra, max_restarts=0):
    stdout, stderr = io.StringIO(), io.StringIO()
    code = launch([WORKER, "--backup-dir", str(backup_dir), "--multi", *extra], nproc=2,
                  max_restarts=max_restarts, grace_period=3, timeout=150,
                  stdout=stdout, stderr=stderr)
    return code, stdout.getvalue(), stderr.getvalue()


@pytest.fixture(scope="module")
def single_reference(tmp_path_factory) -> dict:
    """One process trained without interruption (backups every 3 steps): its result line."""
    return _results(_run_single(tmp_path_factory.mktemp("single_ref")).stdout)[0]


@pytest.fixture(scope="module")
def multi_reference(tmp_path_factory) -> dict[int, dict]:
    """Two workers trained without interruption: every rank's result line."""
    code, out, err = _launch(tmp_path_factory.mktemp("multi_ref"))
    assert code == 0, err
    return _results(out)


def test_single_process_killed_and_restarted_equals_uninterrupted(tmp_path, single_reference):
    reference = single_reference
    crashed = _run_single(tmp_path / "b", "--kill-at", "7")
    assert crashed.returncode == -9  # killed mid-epoch (epoch 0 has 8 steps)
    resumed = _run_single(tmp_path / "b", attempt=1)
    assert "restored epoch=0 step=6" in resumed.stdout  # last backup: every 3 steps
    result = _results(resumed.stdout)[0]
    assert result["steps"] == reference["steps"] == 24
    torch.testing.assert_close(torch.tensor(result["params"]), torch.tensor(reference["params"]), rtol=0, atol=0)
    assert result["loss"] == pytest.approx(reference["loss"], abs=1e-6)
    assert not os.path.exists(tmp_path / "b" / "checkpoint")  # backup deleted at the end


def test_restart_at_epoch_boundary_with_epoch_backups(tmp_path, single_reference):
    reference = single_reference  # backing up every epoch instead of every 3 steps changes nothing
    crashed = _run_single(tmp_path / "b", "--save-freq", "epoch", "--kill-at", "11")
    assert crashed.returncode == -9
    resumed = _run_single(tmp_path / "b", "--save-freq", "epoch", attempt=1)
    assert "restored epoch=1 step=8" in resumed.stdout
    torch.testing.assert_close(torch.tensor(_results(resumed.stdout)[0]["params"]),
                               torch.tensor(reference["params"]), rtol=0, atol=0)


def test_sigterm_single_worker_saves_and_exits(tmp_path):
    preempted = _run_single(tmp_path / "b", "--term-at", "5")
    assert preempted.returncode == 143
    assert td.latest_checkpoint(tmp_path / "b") is not None
    resumed = _run_single(tmp_path / "b", attempt=1)
    assert "restored epoch=0 step=5" in resumed.stdout  # saved at the preemption step


def test_multi_worker_kill_and_restart_equals_uninterrupted(tmp_path, multi_reference):
    reference = multi_reference
    code, out, err = _launch(tmp_path / "b", "--kill-at", "10", max_restarts=1)
    assert code == 0, err
    assert "restarting all workers" in err
    resumed = _results(out)
    assert "restored epoch=1 step=9" in out
    for rank in (0, 1):
        assert resumed[rank]["steps"] == 24
        torch.testing.assert_close(torch.tensor(resumed[rank]["params"]),
                                   torch.tensor(reference[rank]["params"]), rtol=0, atol=0)
    assert resumed[0]["params"] == resumed[1]["params"]


def test_multi_worker_sigterm_all_workers_save_at_the_same_step(tmp_path, multi_reference):
    reference = multi_reference
    code, out, err = _launch(tmp_path / "b", "--term-at", "4", max_restarts=1)
    assert code == 0, err
    # Rank 1 was preempted after step 4 and published step 5: both saved at step 5, exited 143.
    assert "failed with exit code 143" in err
    assert "restored epoch=0 step=5" in out
    resumed = _results(out)
    torch.testing.assert_close(torch.tensor(resumed[0]["params"]),
                               torch.tensor(reference[0]["params"]), rtol=0, atol=0)


def test_bad_arguments():
    with pytest.raises(td.InvalidArgumentError, match="save_freq"):
        td.BackupAndRestore(td.Checkpoint(), "/tmp/x", save_freq=0)
    with pytest.raises(td.InvalidArgumentError, match="td.Checkpoint"):
        td.BackupAndRestore(torch.nn.Linear(1, 1), "/tmp/x")


def test_preemption_checkpoint_handler_saves_on_sigterm_and_resumes(tmp_path):
    """TensorFlow's PreemptionCheckpointHandler: a SIGTERM saves at the step and calls exit_fn;
    a new handler restores the weights and total_run_calls."""
    import signal

    previous = signal.getsignal(signal.SIGTERM)
    exits = []
    try:
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        config = td.experimental.TerminationConfig(exit_fn=lambda: exits.append(True))
        handler = td.experimental.PreemptionCheckpointHandler(
            None, td.Checkpoint(model=model, optimizer=optimizer), os.fspath(tmp_path), termination_config=config)

        def train_step(x):
            loss = model(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        with handler.watch_preemption_scope():
            for step in range(5):
                if step == 3:
                    os.kill(os.getpid(), signal.SIGTERM)
                handler.run(train_step, torch.ones(4, 2))
                if exits:
                    break
        assert exits == [True] and handler.total_run_calls == 4
        saved = [p.detach().clone() for p in model.parameters()]
        restored_model = torch.nn.Linear(2, 1)
        restored = td.experimental.PreemptionCheckpointHandler(
            None, td.Checkpoint(model=restored_model, optimizer=torch.optim.SGD(restored_model.parameters(), lr=0.1)),
            os.fspath(tmp_path))
        assert restored.total_run_calls == 4
        for got, want in zip(restored_model.parameters(), saved, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        with pytest.raises(td.InvalidArgumentError, match="grace_period=...\\) is not supported"):
            td.experimental.TerminationConfig(grace_period=5)
        with pytest.raises(td.InvalidArgumentError, match="needs checkpoint_dir"):
            td.experimental.PreemptionCheckpointHandler(None, td.Checkpoint(model=model))
    finally:
        signal.signal(signal.SIGTERM, previous)
