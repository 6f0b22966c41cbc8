"""Checkpoints under FullyShardedStrategy: each worker writes its own shards
(``torch.distributed.checkpoint``) and the result loads anywhere.

Two launcher jobs (workers: ``tests/multiworker/ckpt_sharded.py``): 2 workers train, save
twice through a ``CheckpointManager(max_to_keep=1)`` and train on; 3 workers restore that
checkpoint and train on as the savers did, then read a plain file written without a strategy.
In this process the same checkpoint restores into ``MirroredStrategy`` and into no strategy,
and ``torch-distribute checkpoint convert`` turns it into one plain file. Every continuation
must end where the uninterrupted run ended. The launcher bounds each job and stops its
workers whatever happens.
"""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_distribute as td
from torch_distribute.cluster.launcher import launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiworker"))
import ckpt_sharded as W  # noqa: E402
import mw_helpers as H  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")

WORKER = str(Path(__file__).resolve().parent / "multiworker" / "ckpt_sharded.py")
TOLERANCE = 1e-5


def _run_job(mode: str, directory: Path, nproc: int, *extra: str, max_restarts: int = 0) -> dict[int, dict]:
    out, err = io.StringIO(), io.StringIO()
    code = launch([WORKER, mode, str(directory), *extra], nproc, env_mode="torchrun", grace_period=2,
                  timeout=120, max_restarts=max_restarts, extra_env={"OMP_NUM_THREADS": "1"},
                  stdout=out, stderr=err)
    assert code == 0, (out.getvalue()[-3000:], err.getvalue()[-3000:])
    results = H.parse_results(out.getvalue())
    assert sorted(results) == list(range(nproc)), out.getvalue()[-3000:]
    return results


def _max_diff(a: list[float], b: list[float]) -> float:
    return float((torch.tensor(a) - torch.tensor(b)).abs().max())


def _flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


@pytest.fixture(scope="module")
def plain_reference(tmp_path_factory):
    """No strategy: train 3+2 batches, write ``plain.pt``, train 3 more (the expected end)."""
    directory = tmp_path_factory.mktemp("sharded_ckpt")
    strategy = td.get_strategy()
    model, optimizer = W.build(strategy, seed=1)
    W.train(strategy, model, optimizer, W.batches(0, 5))
    td.Checkpoint(model=model, optimizer=optimizer).write(directory / "plain.pt")
    W.train(strategy, model, optimizer, W.batches(5, 3))
    return {"directory": directory, "final": _flat(model)}


@pytest.fixture(scope="module")
def saved(plain_reference):
    return _run_job("save", plain_reference["directory"], 2)


@pytest.fixture(scope="module")
def restored(saved, plain_reference):
    return _run_job("restore", plain_reference["directory"], 3)


@pytest.mark.timeout(300)
def test_two_workers_write_their_own_shards_into_one_directory(saved, plain_reference):
    directory = plain_reference["directory"]
    assert saved[0]["saved"] == saved[1]["saved"] == str(directory / "ckpt-2")
    files = sorted(os.listdir(directory / "ckpt-2"))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "layout.pt"]
    # max_to_keep=1 removed the first checkpoint directory; no partial directory is left.
    assert sorted(os.listdir(directory)) == ["checkpoint", "ckpt-2", "plain.pt"]
    # Nothing gathered: each worker's shard file holds about half of the parameters.
    sizes = [os.path.getsize(directory / "ckpt-2" / f"__{r}_0.distcp") for r in range(2)]
    assert max(sizes) < 0.75 * sum(sizes)
    assert saved[0]["local_numel"] + saved[1]["local_numel"] == len(saved[0]["final"])
    # The sharded run itself trains as one process does (same batches, same chief's init).
    assert _max_diff(saved[0]["final"], plain_reference["final"]) < TOLERANCE
    assert saved[0]["final"] == saved[1]["final"]


@pytest.mark.timeout(300)
def test_three_workers_restore_two_workers_shards(saved, restored):
    for rank in range(3):
        assert restored[rank]["save_counter"] == 2
        assert _max_diff(restored[rank]["final"], saved[0]["final"]) < TOLERANCE


@pytest.mark.timeout(300)
def test_plain_file_loads_into_fully_sharded(restored, plain_reference):
    for rank in range(3):
        assert _max_diff(restored[rank]["final_from_plain"], plain_reference["final"]) < TOLERANCE


@pytest.mark.timeout(300)
@pytest.mark.parametrize("target", ["mirrored", "none"])
def test_sharded_checkpoint_restores_into_other_strategies(saved, plain_reference, target):
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"]) if target == "mirrored" else td.get_strategy()
    model, optimizer = W.build(strategy, seed=7)
    checkpoint = td.Checkpoint(model=model, optimizer=optimizer)
    checkpoint.restore(td.latest_checkpoint(plain_reference["directory"])).assert_consumed()
    assert checkpoint.save_counter == 2
    W.train(strategy, model, optimizer, W.batches(5, 3))
    assert _max_diff(_flat(model), saved[0]["final"]) < TOLERANCE


@pytest.mark.timeout(300)
def test_convert_command_writes_one_plain_file(saved, plain_reference, tmp_path):
    source = plain_reference["directory"] / "ckpt-2"
    target = tmp_path / "whole.pt"
    done = subprocess.run([sys.executable, "-m", "torch_distribute.cli", "checkpoint", "convert", str(source), str(target)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    payload = torch.load(target, weights_only=True)
    assert payload["format"] == td.checkpoint.FORMAT and payload["save_counter"] == 2
    assert not any(type(t).__name__ == "DTensor" for t in payload["objects"]["model"].values())
    strategy = td.get_strategy()
    model, optimizer = W.build(strategy, seed=9)
    td.Checkpoint(model=model, optimizer=optimizer).read(target).assert_consumed()
    W.train(strategy, model, optimizer, W.batches(5, 3))
    assert _max_diff(_flat(model), saved[0]["final"]) < TOLERANCE


def test_convert_refuses_what_is_not_a_sharded_checkpoint(tmp_path, capsys):
    from torch_distribute import cli

    assert cli.main(["checkpoint", "convert", str(tmp_path / "missing"), str(tmp_path / "out.pt")]) == 2
    assert "is not a sharded checkpoint directory" in capsys.readouterr().err
    assert not (tmp_path / "out.pt").exists()


def test_a_damaged_sharded_checkpoint_raises_checkpoint_error(tmp_path):
    model = torch.nn.Linear(2, 2)
    path = tmp_path / "ckpt-1"
    from torch_distribute.checkpoint.sharded_io import write_sharded

    payload = {"format": td.checkpoint.FORMAT, "version": td.checkpoint.VERSION, "save_counter": 1,
               "objects": {"model": model.state_dict()}}
    write_sharded(str(path), payload, is_writer=True, barrier=lambda what: None)
    assert td.latest_checkpoint(tmp_path) == str(path)  # found by a scan: no index here
    shard = path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(td.CheckpointError, match="could not be read"):
        td.Checkpoint(model=model).read(path)


@pytest.mark.timeout(300)
def test_backup_and_restore_resumes_sharded_training_after_a_worker_dies(tmp_path):
    """Worker 1 dies at a random step; restarted, both resume from the sharded backup and end
    where an uninterrupted run without a strategy ends."""
    crash_step = random.Random().randint(1, 7)
    results = _run_job("backup", tmp_path, 2, str(crash_step), max_restarts=1)
    assert (tmp_path / "crashed").exists(), f"worker 1 never crashed (step {crash_step})"
    strategy = td.get_strategy()
    model, optimizer = W.build(strategy, seed=1)
    for _ in range(2):
        W.train(strategy, model, optimizer, W.batches(0, 4))
    for rank in range(2):
        assert _max_diff(results[rank]["final"], _flat(model)) < TOLERANCE, f"crash at step {crash_step}"
