"""Tests for td.Checkpoint, td.CheckpointManager and td.latest_checkpoint."""

from __future__ import annotations

import json
import os
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_distribute as td
from torch_distribute.checkpoint import Checkpoint, CheckpointManager, latest_checkpoint
from torch_distribute.checkpoint import object_graph as ckpt_lib
from torch_distribute.errors import CheckpointError, InvalidArgumentError


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _objects(kind: str, seed: int = 0):
    model = _model(seed)
    optimizer = _optimizer(kind, model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    step = torch.zeros((), dtype=torch.int64)
    return model, optimizer, scheduler, step


def _train(model, optimizer, scheduler, step, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        step += 1


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def _files(directory) -> list[str]:
    return sorted(os.listdir(directory))


# -- round trip ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["adam", "sgd_momentum"])
def test_round_trip_continues_training_identically(tmp_path, kind):
    model, optimizer, scheduler, step = _objects(kind, seed=0)
    _train(model, optimizer, scheduler, step, steps=3, seed=1)
    ckpt = Checkpoint(model=model, optimizer=optimizer, scheduler=scheduler, step=step)
    path = ckpt.save(tmp_path / "ckpt")

    model2, optimizer2, scheduler2, step2 = _objects(kind, seed=123)  # different init
    ckpt2 = Checkpoint(model=model2, optimizer=optimizer2, scheduler=scheduler2, step=step2)
    ckpt2.restore(path).assert_consumed()

    _assert_same_state(model, model2)
    assert step2.item() == 3 and step2.dtype == torch.int64
    assert scheduler2.state_dict() == scheduler.state_dict()
    assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert ckpt2.save_counter == 1

    _train(model, optimizer, scheduler, step, steps=3, seed=2)
    _train(model2, optimizer2, scheduler2, step2, steps=3, seed=2)
    _assert_same_state(model, model2)
    assert step.item() == step2.item() == 6
    assert optimizer.param_groups[0]["lr"] == optimizer2.param_groups[0]["lr"]


def test_file_is_plain_weights_only_state(tmp_path):
    model, optimizer, scheduler, step = _objects("adam")
    _train(model, optimizer, scheduler, step, steps=1, seed=0)
    path = Checkpoint(model=model, optimizer=optimizer, scheduler=scheduler, step=step).save(
        tmp_path / "ckpt"
    )
    assert path == str(tmp_path / "ckpt-1") and os.path.isfile(path)

    payload = torch.load(path, weights_only=True)
    assert payload["format"] == "torch-distribute-checkpoint"
    assert payload["version"] == 1
    assert payload["save_counter"] == 1
    assert set(payload["objects"]) == {"model", "optimizer", "scheduler", "step"}
    assert torch.equal(payload["objects"]["model"]["0.weight"], model[0].weight)
    assert payload["objects"]["step"].item() == 1
    assert payload["objects"]["optimizer"]["state"][0]["exp_avg"].device.type == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_state_is_saved_on_cpu(tmp_path):
    model = nn.Linear(3, 2).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3, device="cuda")).sum().backward()
    optimizer.step()
    path = Checkpoint(model=model, optimizer=optimizer, t=torch.ones(2, device="cuda")).write(
        tmp_path / "gpu")
    payload = torch.load(path, weights_only=True)  # no map_location: devices as stored
    stored = [payload["objects"]["t"], *payload["objects"]["model"].values(),
              *payload["objects"]["optimizer"]["state"][0].values()]
    assert all(t.device.type == "cpu" for t in stored)
    cpu_model = nn.Linear(3, 2)
    Checkpoint(model=cpu_model).read(path)
    assert torch.equal(cpu_model.weight, model.weight.cpu())


def test_nested_checkpoint_and_attribute_access(tmp_path):
    inner = Checkpoint(model=nn.Linear(2, 2))
    outer = Checkpoint(inner=inner, step=torch.tensor(5))
    assert outer.inner is inner and outer.step.item() == 5
    path = outer.write(tmp_path / "nested.pt")

    inner2 = Checkpoint(model=nn.Linear(2, 2))
    outer2 = Checkpoint(inner=inner2, step=torch.tensor(0))
    outer2.read(path).assert_consumed()
    assert torch.equal(inner2.model.weight, inner.model.weight)
    assert outer2.step.item() == 5


# -- numbering, index ----------------------------------------------------------------------
def test_save_numbering_index_and_write(tmp_path):
    step = torch.zeros(())
    ckpt = Checkpoint(step=step)
    prefix = str(tmp_path / "sub" / "ckpt")  # parent directory is created
    paths = [ckpt.save(prefix) for _ in range(3)]
    assert paths == [f"{prefix}-1", f"{prefix}-2", f"{prefix}-3"]
    assert ckpt.save_counter == 3
    directory = tmp_path / "sub"
    index = json.loads((directory / "checkpoint").read_text())
    assert index == {"latest": "ckpt-3", "all": ["ckpt-1", "ckpt-2", "ckpt-3"]}
    assert latest_checkpoint(directory) == paths[-1]
    assert td.checkpoint.latest_checkpoint(str(directory)) == paths[-1]

    # write(): exactly that path, no counter, no index.
    written = ckpt.write(directory / "exact.pt")
    assert written == str(directory / "exact.pt")
    assert ckpt.save_counter == 3
    assert json.loads((directory / "checkpoint").read_text()) == index

    ckpt.restore(paths[0])
    assert ckpt.save_counter == 1
    ckpt.save_counter = 7
    ckpt.read(paths[1])  # read leaves the counter alone
    assert ckpt.save_counter == 7


def test_save_with_directory_less_prefix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = Checkpoint(step=torch.tensor(1.0))
    path = ckpt.save("ckpt")
    assert path == "ckpt-1"
    assert latest_checkpoint(".") == os.path.join(".", "ckpt-1")
    ckpt.step.zero_()
    ckpt.restore(path).assert_consumed()
    assert ckpt.step.item() == 1.0


def test_latest_checkpoint_falls_back_without_index(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None
    ckpt = Checkpoint(step=torch.zeros(()))
    for n in (2, 9, 10):  # numeric, not lexical, order
        ckpt.write(tmp_path / f"ckpt-{n}")
    assert latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-10")
    (tmp_path / "checkpoint").write_text("{not json")
    assert latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-10")
    (tmp_path / "checkpoint").write_text(json.dumps({"latest": "ckpt-2", "all": ["ckpt-2"]}))
    assert latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-2")


def test_restore_none_starts_fresh(tmp_path):
    ckpt = Checkpoint(step=torch.zeros(()))
    status = ckpt.restore(latest_checkpoint(tmp_path))
    assert status.missing == ("step",)
    with pytest.raises(CheckpointError):
        status.assert_consumed()


# -- CheckpointManager ---------------------------------------------------------------------
def test_manager_keeps_max_to_keep_and_restores(tmp_path):
    step = torch.zeros((), dtype=torch.int64)
    manager = CheckpointManager(Checkpoint(step=step), tmp_path, max_to_keep=2)
    assert manager.latest_checkpoint is None and manager.checkpoints == []
    assert manager.restore_or_initialize() is None
    for _ in range(4):
        step += 1
        manager.save()
    assert _files(tmp_path) == ["checkpoint", "ckpt-3", "ckpt-4"]
    assert manager.checkpoints == [str(tmp_path / "ckpt-3"), str(tmp_path / "ckpt-4")]
    assert manager.latest_checkpoint == str(tmp_path / "ckpt-4") == latest_checkpoint(tmp_path)
    index = json.loads((tmp_path / "checkpoint").read_text())
    assert index == {"latest": "ckpt-4", "all": ["ckpt-3", "ckpt-4"]}

    # A new manager picks up the existing checkpoints and resumes from the newest.
    step2 = torch.zeros((), dtype=torch.int64)
    ckpt2 = Checkpoint(step=step2)
    manager2 = CheckpointManager(ckpt2, tmp_path, max_to_keep=2)
    assert manager2.checkpoints == manager.checkpoints
    assert manager2.restore_or_initialize() == str(tmp_path / "ckpt-4")
    assert step2.item() == 4 and ckpt2.save_counter == 4
    assert manager2.save() == str(tmp_path / "ckpt-5")
    assert _files(tmp_path) == ["checkpoint", "ckpt-4", "ckpt-5"]

    # checkpoint_number overrides the counter (e.g. the global step).
    assert manager2.save(checkpoint_number=100) == str(tmp_path / "ckpt-100")
    assert _files(tmp_path) == ["checkpoint", "ckpt-100", "ckpt-5"]


def test_manager_keep_all_and_validation(tmp_path):
    manager = CheckpointManager(Checkpoint(step=torch.zeros(())), tmp_path, max_to_keep=None,
                                checkpoint_name="model")
    for _ in range(7):
        manager.save()
    assert len(manager.checkpoints) == 7 and manager.checkpoints[0].endswith("model-1")
    with pytest.raises(InvalidArgumentError):
        CheckpointManager(Checkpoint(), tmp_path, max_to_keep=0)
    with pytest.raises(InvalidArgumentError):
        CheckpointManager(nn.Linear(1, 1), tmp_path)  # type: ignore[arg-type]


# -- errors --------------------------------------------------------------------------------
def test_missing_path_lists_available_checkpoints(tmp_path):
    ckpt = Checkpoint(step=torch.zeros(()))
    ckpt.save(tmp_path / "ckpt")
    ckpt.save(tmp_path / "ckpt")
    with pytest.raises(CheckpointError) as info:
        ckpt.restore(tmp_path / "ckpt-7")
    message = str(info.value)
    assert "ckpt-7" in message and "ckpt-1, ckpt-2" in message
    assert "latest_checkpoint" in message
    assert isinstance(info.value, OSError)

    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoints"):
        ckpt.read(tmp_path / "empty" / "ckpt-1")
    with pytest.raises(CheckpointError, match="no directory"):
        ckpt.read(tmp_path / "absent" / "ckpt-1")
    with pytest.raises(CheckpointError, match="is a directory"):
        ckpt.restore(tmp_path)


def test_corrupt_or_foreign_file_raises_and_previous_still_loads(tmp_path):
    step = torch.zeros(())
    ckpt = Checkpoint(step=step)
    step.fill_(1.0)
    first = ckpt.save(tmp_path / "ckpt")
    step.fill_(2.0)
    second = ckpt.save(tmp_path / "ckpt")

    data = open(second, "rb").read()
    with open(second, "wb") as f:  # truncated
        f.write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="ckpt-2"):
        ckpt.restore(second)

    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"this is not a checkpoint")
    with pytest.raises(CheckpointError, match="garbage"):
        ckpt.read(garbage)

    foreign = tmp_path / "foreign.pt"
    torch.save({"weight": torch.ones(2)}, foreign)
    with pytest.raises(CheckpointError, match="not a torch-distribute checkpoint"):
        ckpt.read(foreign)

    ckpt.restore(first).assert_consumed()
    assert step.item() == 1.0


_unpickled_code_ran = []


class _RunsCodeWhenUnpickled:
    def __reduce__(self):
        return (_unpickled_code_ran.append, ("ran",))


def test_loading_never_runs_pickled_code(tmp_path):
    path = tmp_path / "evil"
    torch.save({"format": "torch-distribute-checkpoint", "version": 1, "save_counter": 1,
                "objects": {"step": _RunsCodeWhenUnpickled()}}, path)
    with pytest.raises(CheckpointError, match="weights_only"):
        Checkpoint(step=torch.zeros(())).read(path)
    assert _unpickled_code_ran == []


def test_failed_save_is_atomic(tmp_path, monkeypatch):
    step = torch.ones(())
    ckpt = Checkpoint(step=step)
    first = ckpt.save(tmp_path / "ckpt")
    first_bytes = open(first, "rb").read()
    index_bytes = (tmp_path / "checkpoint").read_bytes()

    def failing_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", failing_save)
    step.fill_(5.0)
    with pytest.raises(CheckpointError, match="No space left") as info:
        ckpt.save(tmp_path / "ckpt")
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(CheckpointError):
        ckpt.write(first)  # overwriting in place fails too: the old file must survive
    monkeypatch.undo()

    assert _files(tmp_path) == ["checkpoint", "ckpt-1"]  # no temp files, no ckpt-2
    assert open(first, "rb").read() == first_bytes
    assert (tmp_path / "checkpoint").read_bytes() == index_bytes
    assert ckpt.save_counter == 1  # a retry gets the same number
    ckpt.restore(latest_checkpoint(tmp_path)).assert_consumed()
    assert step.item() == 1.0
    assert ckpt.save(tmp_path / "ckpt") == str(tmp_path / "ckpt-2")


def test_shape_mismatch_names_the_object(tmp_path):
    path = Checkpoint(model=nn.Linear(4, 2), step=torch.zeros(3)).write(tmp_path / "c")
    with pytest.raises(CheckpointError, match="'model'") as info:
        Checkpoint(model=nn.Linear(4, 3)).read(path)
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(CheckpointError, match="'step'"):
        Checkpoint(step=torch.zeros(4)).read(path)


@pytest.mark.parametrize("bad", [0, [1, 2], "text"])
def test_non_saveable_object_is_rejected(bad):
    with pytest.raises(InvalidArgumentError, match=r"torch\.zeros\(\(\), dtype=torch\.int64\)"):
        Checkpoint(model=nn.Linear(1, 1), counter=bad)


def test_class_instead_of_instance_is_rejected():
    with pytest.raises(InvalidArgumentError, match="not an instance"):
        Checkpoint(model=nn.Linear)


def test_reserved_names_are_rejected():
    with pytest.raises(InvalidArgumentError, match="reserved"):
        Checkpoint(save_counter=torch.zeros(()))
    with pytest.raises(InvalidArgumentError, match="reserved"):
        Checkpoint(restore=torch.zeros(()))


def test_assert_consumed_reports_both_directions(tmp_path):
    model, optimizer = nn.Linear(2, 2), None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = Checkpoint(model=model, optimizer=optimizer).write(tmp_path / "c")

    status = Checkpoint(model=nn.Linear(2, 2), optimizer=torch.optim.SGD(model.parameters(), lr=1)
                        ).read(path)
    assert status.assert_consumed() is status

    target = nn.Linear(2, 2)
    extra = torch.zeros(())
    status = Checkpoint(model=target, inner=Checkpoint(extra=extra)).read(path)
    assert torch.equal(target.weight, model.weight)  # matched objects are restored anyway
    assert status.missing == ("inner",) and status.unexpected == ("optimizer",)
    with pytest.raises(CheckpointError, match="optimizer") as info:
        status.assert_consumed()
    assert "inner" in str(info.value)
    assert status.expect_partial() is status

    nested_path = Checkpoint(inner=Checkpoint(a=torch.zeros(()))).write(tmp_path / "n")
    status = Checkpoint(inner=Checkpoint(b=torch.zeros(()))).read(nested_path)
    assert status.missing == ("inner.b",) and status.unexpected == ("inner.a",)


def test_non_chief_computes_state_but_writes_nothing(tmp_path, monkeypatch):
    fake = types.SimpleNamespace(extended=types.SimpleNamespace(should_checkpoint=False, checkpoint_is_sharded=False))
    monkeypatch.setattr(ckpt_lib.context, "get_strategy", lambda: fake)
    ckpt = Checkpoint(step=torch.zeros(()))
    assert ckpt.save(tmp_path / "ckpt") == str(tmp_path / "ckpt-1")
    assert ckpt.save_counter == 1
    manager = CheckpointManager(ckpt, tmp_path / "m", max_to_keep=1)
    assert manager.save() == str(tmp_path / "m" / "ckpt-2")
    assert ckpt.write(tmp_path / "exact") == str(tmp_path / "exact")
    assert not any(tmp_path.iterdir())


# -- strategies ----------------------------------------------------------------------------
def _mirrored_step(strategy, model, optimizer, x, y):
    def step(xs, ys):
        loss = td.compute_average_loss(
            F.mse_loss(model(xs), ys, reduction="none").mean(1), global_batch_size=len(x))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    for xs, ys in strategy.experimental_distribute_dataset([(x, y)]):
        strategy.run(step, args=(xs, ys))


def test_mirrored_checkpoint_loads_without_strategy_and_into_other_replica_count(tmp_path):
    """Model, optimizer and metric saved from 2 replicas restore into 1 and 3 replicas."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen)
    two = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with two.scope():
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        mean = td.metrics.Mean()
        ckpt = Checkpoint(model=model, optimizer=optimizer, mean=mean)
    _mirrored_step(two, model, optimizer, x, y)
    per_replica = td.PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([6.0])])
    two.run(lambda v: mean.update_state(v), args=(per_replica,))
    path = ckpt.save(tmp_path / "ckpt")

    plain = nn.Linear(4, 2)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    plain_mean = td.metrics.Mean()
    Checkpoint(model=plain, optimizer=plain_opt, mean=plain_mean).restore(path).assert_consumed()
    _assert_same_state(model, plain)
    assert plain_mean.result().item() == 3.0

    three = td.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    with three.scope():
        model3 = nn.Linear(4, 2)
        opt3 = torch.optim.SGD(model3.parameters(), lr=0.1, momentum=0.9)
        mean3 = td.metrics.Mean()
        Checkpoint(model=model3, optimizer=opt3, mean=mean3).restore(path).assert_consumed()
    _assert_same_state(model, model3)
    assert mean3.result().item() == 3.0  # totals preserved under a different replica count
    # Every replica's copy holds the restored values.
    copies = three.experimental_local_results(three.run(lambda: model3.weight * 1))
    assert len(copies) == 3
    for copy in copies:
        assert torch.equal(copy.detach(), model.weight.detach())

    # One more step from the restored state agrees everywhere (momentum restored too).
    x2, y2 = torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen)
    _mirrored_step(two, model, optimizer, x2, y2)
    _mirrored_step(three, model3, opt3, x2, y2)
    loss = F.mse_loss(plain(x2), y2, reduction="none").mean(1).sum() / 6
    loss.backward()
    plain_opt.step()
    for a, b, c in zip(model.parameters(), model3.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, c)
