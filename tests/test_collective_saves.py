"""Checkpoint writes are collective under several workers: every worker returns only once the
chief's file is complete, a restore on every worker then reads the same weights, and a
failed write raises on every worker.

The first tests drive ``collective.write_collectively`` with two threads standing in for two
workers (fast, and they can fake what a shared disk cannot: each worker its own disk). The
last runs ``tests/multiworker/collective_saves_job.py`` on 2 worker processes
(MultiWorkerMirroredStrategy, CPU, Gloo) under the launcher, whose timeout stops every worker
whatever happens.
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time
import types
import warnings
from pathlib import Path

import pytest
import torch

import torch_distribute as td
from torch_distribute.checkpoint import collective, file_io
from torch_distribute.cluster.launcher import launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mw_helpers as H  # noqa: E402

JOB = str(Path(__file__).resolve().parent / "multiworker" / "collective_saves_job.py")


# -- the protocol, with two threads as two workers -----------------------------------------------
class _Group:
    """``all_gather_objects`` for threads; counts the calls of each worker and, as the real
    worker group does, checks that every worker names the collective the same."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=20)
        self.slots: list = [None] * size
        self.calls = [0] * size

    def gather(self, rank: int, value, what: str):
        self.calls[rank] += 1
        self.slots[rank] = (what, value)
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        assert len({name for name, _ in out}) == 1, f"different collectives: {out}"
        return [v for _, v in out]


class _Extended:
    def __init__(self, group: _Group, rank: int):
        self.group, self.worker_index, self.num_workers_in_sync = group, rank, group.size
        self.should_checkpoint = rank == 0

    def all_gather_objects(self, obj, what: str):
        return self.group.gather(self.worker_index, obj, what)


def _run_workers(paths: list[str], writers: list) -> tuple[list, list, _Group]:
    """Run ``write_collectively`` on one thread per worker; (return time or error per worker)."""
    group = _Group(len(paths))
    finished: list = [None] * len(paths)
    errors: list = [None] * len(paths)

    def worker(rank: int) -> None:
        try:
            collective.write_collectively(_Extended(group, rank), paths[rank], writers[rank])
            finished[rank] = (time.monotonic(), os.path.exists(paths[rank]))
        except Exception as exc:  # noqa: BLE001 - checked by the test
            errors[rank] = exc

    threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(len(paths))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "a worker hangs"
    return finished, errors, group


def _writer(path: str, calls: list, payload: float = 1.0, delay: float = 0.0, fail: str | None = None):
    def write() -> str:
        calls.append(path)
        time.sleep(delay)
        if fail:
            raise td.CheckpointError(fail)
        return file_io.save_file(path, {"w": torch.tensor(payload)})
    return write


def test_every_worker_returns_once_the_chiefs_file_exists_and_the_chief_alone_writes(tmp_path):
    path = str(tmp_path / "ckpt-1")
    calls: list = []
    finished, errors, group = _run_workers([path, path], [_writer(path, calls, delay=0.5), _writer(path, calls)])
    assert errors == [None, None]
    assert finished[1][1] is True  # the file existed when worker 1 returned
    assert calls == [path]  # worker 1 saw the chief's file: it wrote nothing
    assert group.calls == [2, 2]


def test_a_non_chief_asking_for_its_own_path_writes_its_own_copy(tmp_path):
    mine, theirs = str(tmp_path / "chief" / "ckpt-1"), str(tmp_path / "worker1" / "ckpt-1")
    calls: list = []
    finished, errors, _ = _run_workers([mine, theirs], [_writer(mine, calls), _writer(theirs, calls)])
    assert errors == [None, None] and sorted(calls) == sorted([mine, theirs])
    assert finished[0][1] and finished[1][1]


def test_on_separate_disks_a_non_chief_writes_the_chiefs_path_itself(tmp_path):
    """The chief's file lands on 'its own disk' (elsewhere): worker 1 does not see it at the
    path, so it writes its own copy there; a stale file of another checkpoint is replaced."""
    path = str(tmp_path / "ckpt-1")
    for stale in (False, True):
        if stale:
            file_io.save_file(path, {"w": torch.tensor(-1.0)})
        calls: list = []
        chiefs_disk = str(tmp_path / "chiefs_disk" / "ckpt-1")
        finished, errors, _ = _run_workers([path, path], [_writer(chiefs_disk, calls), _writer(path, calls)])
        assert errors == [None, None] and calls == [chiefs_disk, path]
        assert torch.load(path, weights_only=True)["w"].item() == 1.0
        os.remove(path)


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failed_write_raises_on_every_worker(tmp_path, failing):
    """The chief's write fails (worker 0), or a non-chief's own copy does (worker 1)."""
    paths = [str(tmp_path / "a" / "ckpt-1"), str(tmp_path / "b" / "ckpt-1")]
    calls: list = []
    writers = [_writer(paths[r], calls, fail="disk full" if r == failing else None) for r in range(2)]
    _, errors, group = _run_workers(paths, writers)
    assert all(isinstance(e, td.CheckpointError) for e in errors)
    other = errors[1 - failing]
    assert f"worker {failing}" in str(other) and "disk full" in str(other) and "every worker" in str(other)
    assert group.calls == [2, 2]


def test_one_worker_uses_no_collective(tmp_path):
    class One:
        num_workers_in_sync, worker_index, should_checkpoint = 1, 0, True

        def all_gather_objects(self, obj, what):
            raise AssertionError("no collective in one process")

    calls: list = []
    collective.write_collectively(One(), str(tmp_path / "c"), _writer(str(tmp_path / "c"), calls))
    assert calls == [str(tmp_path / "c")]


def _restore_on_workers(monkeypatch, directories: list) -> tuple[list, list, list]:
    """``CheckpointManager.restore_or_initialize`` on one thread per worker, each in its own
    directory (its own disk); (restored paths, errors, restored values)."""
    from torch_distribute.checkpoint import manager as manager_module

    group, local = _Group(len(directories)), threading.local()
    monkeypatch.setattr(manager_module, "owning_strategy",
                        lambda objects: types.SimpleNamespace(extended=local.extended))
    restored: list = [None] * len(directories)
    errors: list = [None] * len(directories)
    values: list = [None] * len(directories)

    def worker(rank: int) -> None:
        local.extended = _Extended(group, rank)
        step = torch.zeros(())
        try:
            restored[rank] = td.CheckpointManager(td.Checkpoint(step=step), directories[rank]).restore_or_initialize()
        except Exception as exc:  # noqa: BLE001 - checked by the test
            errors[rank] = exc
        values[rank] = step.item()

    threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(len(directories))]
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "a worker hangs"
    return restored, errors, values


def _saves(directory, count: int) -> list[str]:
    step = torch.zeros(())
    manager = td.CheckpointManager(td.Checkpoint(step=step), directory)
    paths = []
    for _ in range(count):
        step += 1
        paths.append(manager.save())
    return paths


def test_restore_or_initialize_falls_back_together_when_one_worker_sees_damage(tmp_path, monkeypatch):
    mine, theirs = _saves(tmp_path / "w0", 3), _saves(tmp_path / "w1", 3)
    data = bytearray(open(theirs[2], "rb").read())
    data[data.find(b"data.pkl") + 40] ^= 1  # damaged inside: only the full checksum sees it
    open(theirs[2], "wb").write(bytes(data))
    restored, errors, values = _restore_on_workers(monkeypatch, [tmp_path / "w0", tmp_path / "w1"])
    assert errors == [None, None]
    assert restored == [mine[1], theirs[1]] and values == [2.0, 2.0]  # both fell back to ckpt-2


def test_restore_or_initialize_refuses_to_let_workers_restore_different_checkpoints(tmp_path, monkeypatch):
    _saves(tmp_path / "w0", 3)
    _saves(tmp_path / "w1", 2)  # worker 1's directory lacks ckpt-3
    restored, errors, _ = _restore_on_workers(monkeypatch, [tmp_path / "w0", tmp_path / "w1"])
    assert all(isinstance(e, td.CheckpointError) and "restored different checkpoints" in str(e) for e in errors)


# -- two worker processes ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def job(tmp_path_factory):
    directory = tmp_path_factory.mktemp("collective_saves")
    out, err = io.StringIO(), io.StringIO()
    code = launch([JOB, str(directory)], 2, env_mode="torchrun", grace_period=2, timeout=240,
                  extra_env={"OMP_NUM_THREADS": "1"}, stdout=out, stderr=err)
    text = out.getvalue() + err.getvalue()
    assert code == 0, text[-4000:]
    results = H.parse_results(out.getvalue())
    assert sorted(results) == [0, 1], text[-4000:]
    for rank in (0, 1):
        assert results[rank]["errors"] == {}, results[rank]["errors"]
    return {"directory": directory, "results": results}


def _same_on_both(job: dict, section: str, key: str):
    a, b = job["results"][0][section][key], job["results"][1][section][key]
    assert a == b, f"{section}.{key} differs between the workers"
    return a


@pytest.mark.timeout(300)
def test_save_then_restore_latest_on_every_worker(job):
    for i in range(2):
        for rank in (0, 1):
            entry = job["results"][rank]["save_then_restore_latest"][i]
            assert entry["exists"] and entry["latest"] == entry["path"] == str(job["directory"] / "shared" / f"ckpt-{i + 1}")
            assert entry["restored"] == entry["trained"]  # bitwise: the newest file, on both workers
        assert job["results"][0]["save_then_restore_latest"][i] == job["results"][1]["save_then_restore_latest"][i]


@pytest.mark.timeout(300)
def test_write_then_read_and_manager_save_then_restore(job):
    assert _same_on_both(job, "write_then_read", "exists") is True
    assert _same_on_both(job, "write_then_read", "restored") == _same_on_both(job, "write_then_read", "trained")
    saves = _same_on_both(job, "manager_save_then_restore", "saves")
    assert all(s["exists"] for s in saves)
    assert _same_on_both(job, "manager_save_then_restore", "restored_path") == saves[-1]["path"]
    assert (_same_on_both(job, "manager_save_then_restore", "restored")
            == _same_on_both(job, "manager_save_then_restore", "trained"))
    assert sorted(os.listdir(job["directory"] / "managed")) == ["checkpoint", "ckpt-2", "ckpt-3"]


@pytest.mark.timeout(300)
def test_tutorial_non_chief_temporary_directory(job):
    chief, worker = job["results"][0]["tutorial_write_filepath"], job["results"][1]["tutorial_write_filepath"]
    assert worker["write_dir"] != chief["write_dir"]
    for result in (chief, worker):
        assert all(s["exists"] for s in result["saves"])  # the returned path exists on each
        assert [os.path.basename(s["path"]) for s in result["saves"]] == ["ckpt-1", "ckpt-2", "ckpt-3"]
        assert result["listing"] == ["checkpoint", "ckpt-2", "ckpt-3"]  # its own index, max_to_keep=2
        assert result["latest_here"] == result["saves"][-1]["path"]
        assert result["restored"] == result["trained"]
    assert worker["cleaned"] and not os.path.exists(worker["write_dir"])
    assert chief["trained"] == worker["trained"]


@pytest.mark.timeout(300)
def test_model_checkpoint_best_then_load_weights_leaves_equal_weights(job):
    assert _same_on_both(job, "keras_best_then_load", "exists") is True
    loaded = _same_on_both(job, "keras_best_then_load", "loaded")
    assert _same_on_both(job, "keras_best_then_load", "save_weights_exists") is True
    assert _same_on_both(job, "keras_best_then_load", "saved")  # the same decisions on both
    model = H.make_model()
    td.Checkpoint(model=model).read(job["directory"] / "keras" / "best.pt")
    assert H.flat(model) == loaded


@pytest.mark.timeout(300)
def test_backup_is_complete_when_the_step_after_it_starts(job):
    seen = _same_on_both(job, "backup_and_restore", "seen")
    backup_dir = job["directory"] / "backup"
    assert seen == [str(backup_dir / "backup-1"), str(backup_dir / "backup-2")]
    assert _same_on_both(job, "backup_and_restore", "latest") == str(backup_dir / "backup-3")


@pytest.mark.timeout(300)
def test_the_chiefs_failed_write_raises_on_both_workers(job):
    for rank in (0, 1):
        result = job["results"][rank]["chief_fails"]
        assert result["raised"] is not None and result["raised"].startswith("CheckpointError")
        assert "blocker" in result["raised"] and result["after_exists"]
    assert "worker 0 (the chief) failed" in job["results"][1]["chief_fails"]["raised"]
