"""A loss averaged over one replica's batch (DDP's habit) is refused before the first update.

Each test writes the step as a DDP user writes it (``F.cross_entropy(logits, y)``,
``nn.CrossEntropyLoss()``, ``F.mse_loss``, ``per_example.mean()``), under MirroredStrategy and
CentralStorageStrategy with 2 CPU replicas and MultiWorkerMirrored / FullySharded with 2
workers; asserts the error text, that the parameters did not move, that the correct form
(``td.compute_average_loss``) trains as one device does, and that the opt-out trains as asked
(a per-replica mean: twice the one-device update with 2 equal halves).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import torch_distribute as td
from torch_distribute.cluster.launcher import free_ports

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mw_helpers as H  # noqa: E402
import proc_helpers as P  # noqa: E402

pytestmark = pytest.mark.timeout(120)

GLOBAL_BATCH = 8
LR = 0.5


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(11)
    return [(torch.randn(GLOBAL_BATCH, 4, generator=generator), torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator))
            for _ in range(2)]


def _build(strategy: td.Strategy) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(H.CHIEF_SEED)
    with strategy.scope():
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    return model, optimizer


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _one_device(batches: list, loss_of, then: list = ()) -> torch.Tensor:
    """The hand-written loop on one device with the whole global batch (``then``: more
    ``(batch, loss_of)`` steps)."""
    torch.manual_seed(H.CHIEF_SEED)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for (x, y), loss in [*[(b, loss_of) for b in batches], *then]:
        loss(model, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return _flat(model)


def _ddp_habits(criterion_module: torch.nn.Module) -> dict:
    """Loss functions as DDP code writes them."""
    return {
        "F.cross_entropy": lambda logits, y: F.cross_entropy(logits, y),
        "nn.CrossEntropyLoss()": lambda logits, y: criterion_module(logits, y),
        "F.mse_loss": lambda logits, y: F.mse_loss(logits, F.one_hot(y, 3).float()),
        "per_example.mean()": lambda logits, y: F.cross_entropy(logits, y, reduction="none").mean(),
        "F.l1_loss": lambda logits, y: F.l1_loss(logits, F.one_hot(y, 3).float()),
        "torch.mean": lambda logits, y: torch.mean((logits - 1.0) ** 2),
        "weighted sum of means": lambda logits, y: F.cross_entropy(logits, y) + 0.1 * logits.square().mean(),
        "mean plus correct term": lambda logits, y: (
            td.compute_average_loss(F.cross_entropy(logits, y, reduction="none"), global_batch_size=GLOBAL_BATCH)
            + F.cross_entropy(logits, y)),
        "gradient accumulation habit": lambda logits, y: F.cross_entropy(logits, y) / 3,
    }


@pytest.mark.parametrize("make_strategy", [
    lambda: td.MirroredStrategy(["cpu:0", "cpu:1"]),
    lambda: td.CentralStorageStrategy(["cpu:0", "cpu:1"]),
], ids=["mirrored", "central_storage"])
def test_ddp_style_mean_losses_raise_before_the_first_update(make_strategy):
    strategy = make_strategy()
    model, optimizer = _build(strategy)
    before = _flat(model).clone()
    criterion = torch.nn.CrossEntropyLoss()
    scaler = torch.amp.GradScaler("cpu")
    habits = _ddp_habits(criterion)
    habits["GradScaler.scale(F.cross_entropy)"] = None
    batch = next(iter(strategy.experimental_distribute_dataset(_data()[:1])))
    for name, loss_of in habits.items():
        def step(x, y, loss_of=loss_of):
            logits = model(x)
            if loss_of is None:
                scaler.scale(F.cross_entropy(logits, y)).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss_of(logits, y).backward()
                optimizer.step()
            optimizer.zero_grad()

        with pytest.raises(td.LossScalingError) as raised:
            strategy.run(step, args=batch)
            pytest.fail(f"{name}: not refused")
        message = str(raised.value)
        assert "2 replicas in sync" in message and "2x the one-device update" in message, (name, message)
        assert 'reduction="none"' in message, name
        assert "td.compute_average_loss(per_example, global_batch_size=" in message, name
        assert "td.config.set_loss_scaling_check(False)" in message, name
        torch.testing.assert_close(_flat(model), before, rtol=0, atol=0)  # nothing applied
    with pytest.raises(td.LossScalingError, match=r'F\.mse_loss with reduction="mean"'):
        strategy.run(lambda x, y: F.mse_loss(model(x), F.one_hot(y, 3).float()).backward(), args=batch)
    with pytest.raises(td.LossScalingError, match=r"F\.cross_entropy / F\.nll_loss"):
        strategy.run(lambda x, y: F.cross_entropy(model(x), y).backward(), args=batch)
    assert isinstance(raised.value, td.DistributeError)


def test_correct_forms_train_as_one_device():
    """compute_average_loss; a per-example mean over non-batch dims; a mean divided by the
    replicas; fit's own scaling: no error, and one device's parameters."""
    batches = _data()
    forms = {
        "compute_average_loss": lambda logits, y: td.compute_average_loss(
            F.cross_entropy(logits, y, reduction="none"), global_batch_size=GLOBAL_BATCH),
        "per-example mean over classes": lambda logits, y: td.compute_average_loss(
            (logits - F.one_hot(y, 3).float()).square().mean(dim=-1), global_batch_size=GLOBAL_BATCH),
        "sum over the global batch": lambda logits, y: F.cross_entropy(logits, y, reduction="sum") / GLOBAL_BATCH,
        "mean / num_replicas_in_sync": lambda logits, y: F.cross_entropy(logits, y) / 2,
        "mean / replicas / accumulation": lambda logits, y: F.cross_entropy(logits, y) / 2 / 1,
    }
    one_device = {
        "compute_average_loss": lambda m, x, y: F.cross_entropy(m(x), y),
        "per-example mean over classes": lambda m, x, y: (m(x) - F.one_hot(y, 3).float()).square().mean(),
        "sum over the global batch": lambda m, x, y: F.cross_entropy(m(x), y),
        "mean / num_replicas_in_sync": lambda m, x, y: F.cross_entropy(m(x), y),
        "mean / replicas / accumulation": lambda m, x, y: F.cross_entropy(m(x), y),
    }
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    for name, loss_of in forms.items():
        model, optimizer = _build(strategy)

        def step(x, y, loss_of=loss_of, model=model, optimizer=optimizer):
            loss = loss_of(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        for batch in strategy.experimental_distribute_dataset(batches):
            strategy.run(step, args=batch)
        torch.testing.assert_close(_flat(model), _one_device(batches, one_device[name]), msg=name)


def test_opt_out_trains_the_per_replica_mean_as_asked():
    """Turned off (per strategy, or for every strategy): each replica's mean, summed: with 2
    equal halves, twice the one-device update."""
    batches = _data()
    twice = _one_device(batches, lambda m, x, y: 2 * F.cross_entropy(m(x), y))
    for turn_off in ("strategy", "config"):
        strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
        if turn_off == "strategy":
            strategy.set_loss_scaling_check(False)
        else:
            td.config.set_loss_scaling_check(False)
        try:
            assert not strategy.loss_scaling_check
            model, optimizer = _build(strategy)

            def step(x, y, model=model, optimizer=optimizer):
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()

            for batch in strategy.experimental_distribute_dataset(batches):
                strategy.run(step, args=batch)
        finally:
            td.config.set_loss_scaling_check(True)
        torch.testing.assert_close(_flat(model), twice, msg=turn_off)
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    td.config.set_loss_scaling_check(False)
    strategy.set_loss_scaling_check(True)  # the strategy's own setting wins
    try:
        assert strategy.loss_scaling_check
    finally:
        td.config.set_loss_scaling_check(True)
    with pytest.raises(td.InvalidArgumentError, match="True or False"):
        td.config.set_loss_scaling_check("off")
    with pytest.raises(td.InvalidArgumentError, match="True, False or None"):
        strategy.set_loss_scaling_check(0)


def test_one_replica_and_plain_torch_are_not_checked():
    """A mean is the right loss on one device: no strategy, OneDevice, Mirrored with one device."""
    batches = _data()
    for strategy in (td.OneDeviceStrategy("cpu"), td.MirroredStrategy(["cpu:0"])):
        model, optimizer = _build(strategy)

        def step(x, y, model=model, optimizer=optimizer):
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()

        for batch in strategy.experimental_distribute_dataset(batches):
            strategy.run(step, args=batch)
        torch.testing.assert_close(_flat(model), _one_device(batches, lambda m, x, y: F.cross_entropy(m(x), y)))
    model = torch.nn.Linear(4, 3)
    F.cross_entropy(model(batches[0][0]), batches[0][1]).backward()  # outside run: untouched


def test_fit_is_not_refused():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    x, y = torch.cat([b[0] for b in _data()]), torch.cat([b[1] for b in _data()])
    with strategy.scope():
        model = td.keras.Model(torch.nn.Linear(4, 3))
        model.compile(td.keras.optimizers.SGD(learning_rate=LR),
                      td.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
    with strategy.scope():
        model.compile(td.keras.optimizers.SGD(learning_rate=LR), "mse")
    model.fit(x, F.one_hot(y, 3).float(), batch_size=GLOBAL_BATCH, epochs=1, verbose=0)


def _habits_job(tmp_path: Path, *extra: str) -> dict[int, dict]:
    job = str(Path(__file__).resolve().parent / "multiworker" / "habits_job.py")
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]}
    with P.processes(tmp_path) as procs:
        workers = [procs.spawn([job, *extra], P.clean_env(MW_RANK=str(rank), TF_CONFIG=json.dumps(
                       {"cluster": cluster, "task": {"type": "worker", "index": rank}})), f"habits{rank}")
                   for rank in range(2)]
        return H.results_of_clean_exits(procs, workers, 100)


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")
def test_multi_worker_mirrored_two_workers(tmp_path):
    """The loss check, and (same job, to start it once) a NaN in one worker's batch."""
    reports = _habits_job(tmp_path)
    batches = _data()
    for rank in range(2):
        report = reports[rank]
        assert "2 replicas in sync" in report["mean_error"], report["mean_error"]
        assert "td.compute_average_loss" in report["mean_error"]
        assert report["after_mean"] == report["init"]  # refused before the first update
    mean = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    torch.testing.assert_close(torch.tensor(reports[0]["after_correct"]), _one_device(batches, mean))
    # Opted out: each worker's mean over its 4 rows, summed: twice the one-device step.
    twice = _one_device(batches, mean, then=[(batches[0], lambda m, x, y: 2 * mean(m, x, y))])
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(reports[rank]["after_opt_out"]), twice)
    # One NaN in worker 1's rows of the third batch: both workers warn once, naming it.
    for rank in range(2):
        report = reports[rank]
        assert len(report["warn_warnings"]) == 1, report["warn_warnings"]
        text = report["warn_warnings"][0]
        assert "optimizer step 3 (SGD)" in text and "replica 1 (worker 1): loss nan" in text, text
        assert not report["warn_params_finite"]  # warned, as asked; the update spread it
        assert "optimizer step 3 (SGD)" in report["raise_error"] and "replica 1 (worker 1)" in report["raise_error"]
        assert report["raise_params_finite"]  # stopped before the update
    # The log (a handler the job added, level DEBUG): what the strategy decided, each collective.
    for rank in range(2):
        log = "\n".join(reports[rank]["log"])
        assert (f"INFO torch_distribute.strategies: MultiWorkerMirroredStrategy: 2 replica(s) in sync = "
                f"2 worker(s) x 1 local replica(s) on cpu:0; this process is worker {rank}") in log, log
        assert "cluster found by TFConfigClusterResolver" in log, log
        assert f"INFO torch_distribute.collectives: worker {rank} of 2: process group on backend gloo" in log, log
        assert "DEBUG torch_distribute.collectives: collective #" in log and "initial broadcast from the chief" in log, log
        assert "DEBUG torch_distribute.collectives: gradient bucket all-reduce" in log, log


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")
def test_fully_sharded_two_workers(tmp_path):
    reports = _habits_job(tmp_path, "--sharded")
    for rank in range(2):
        report = reports[rank]
        assert "2 replicas in sync" in (report["mean_error"] or ""), report
        assert report["after_mean"] == report["init"]
        assert report["after_opt_out"] != report["after_correct"]
