"""A NaN in one replica's batch is reported (step, replica, worker), not spread silently.

Under MirroredStrategy with 2 CPU replicas (the 2-worker case runs in
``tests/test_loss_scaling_check.py``'s job): a warning by default, once; ``td.NonFiniteError``
before the update with ``td.config.set_nonfinite_check("raise")``; nothing with ``"off"``;
Keras' ``TerminateOnNaN`` still stops ``fit``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_distribute as td

pytestmark = pytest.mark.timeout(120)

GLOBAL_BATCH = 8


@pytest.fixture(autouse=True)
def _default_mode():
    yield
    td.config.set_nonfinite_check("warn")


def _data(nan_at: int | None = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    data = [(torch.randn(GLOBAL_BATCH, 4, generator=generator), torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator))
            for _ in range(8)]
    if nan_at is not None:
        data[nan_at][0][6, 1] = float("nan")  # row 6: replica 1's half
    return data


def _train(strategy: td.Strategy, data: list) -> tuple[torch.nn.Module, list[str]]:
    with strategy.scope():
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, y):
        loss = td.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"), global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in strategy.experimental_distribute_dataset(data):
            strategy.run(step, args=batch)
    return model, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def _finite(model: torch.nn.Module) -> bool:
    return all(bool(p.isfinite().all()) for p in model.parameters())


def test_warns_once_naming_the_step_replica_and_worker():
    model, caught = _train(td.MirroredStrategy(["cpu:0", "cpu:1"]), _data())
    assert len(caught) == 1, caught  # the first step only, not every step after it
    assert "optimizer step 5 (SGD)" in caught[0] and "replica 1 (worker 0): loss nan" in caught[0]
    assert 'set_nonfinite_check("raise")' in caught[0]
    assert not _finite(model)  # warned: the update went on, as by default


def test_raise_stops_before_the_update_and_off_says_nothing():
    td.config.set_nonfinite_check("raise")
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with pytest.raises(td.NonFiniteError, match=r"optimizer step 5 \(SGD\).*replica 1 \(worker 0\)"):
        _train(strategy, _data())
    td.config.set_nonfinite_check("off")
    model, caught = _train(strategy, _data())
    assert caught == [] and not _finite(model)
    with pytest.raises(td.InvalidArgumentError, match="warn"):
        td.config.set_nonfinite_check("error")


def test_finite_training_is_unchanged_and_silent():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    td.config.set_nonfinite_check("raise")
    model, caught = _train(strategy, _data(nan_at=None))
    assert caught == [] and _finite(model)


def test_an_overflow_without_a_nan_loss_is_named_as_such():
    td.config.set_nonfinite_check("raise")
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        layer = torch.nn.Linear(2, 1, bias=False)
        torch.nn.init.constant_(layer.weight, 0.01)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)

    def step(x):
        # A finite loss on each replica, a gradient of 3e38 on each: their sum overflows.
        layer(x).sum().mul(1e38).backward()
        optimizer.step()

    (batch,) = list(strategy.experimental_distribute_dataset([torch.full((2, 2), 3.0)]))
    with pytest.raises(td.NonFiniteError, match="Every replica's loss was finite"):
        strategy.run(step, args=(batch,))


def test_fit_terminate_on_nan_keeps_its_meaning():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    data = _data(nan_at=2)
    x, y = torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
    with strategy.scope():
        model = td.keras.Model(torch.nn.Linear(4, 3))
        model.compile(td.keras.optimizers.SGD(learning_rate=0.1),
                      td.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.warns(RuntimeWarning, match="optimizer step 3"):
        history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0, shuffle=False,
                            callbacks=[td.keras.callbacks.TerminateOnNaN()])
    assert len(history.history["loss"]) == 1  # stopped in the first epoch, at the NaN batch
