"""Sync-on-read metrics: hand-computed values, and the same values under 1, 2 and 3 replicas."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_distribute as td
from torch_distribute import metrics
from torch_distribute.errors import ContextError, InvalidArgumentError

_STRATEGIES: dict[int, td.MirroredStrategy] = {}


def mirrored(n: int) -> td.MirroredStrategy:
    """One MirroredStrategy over ``n`` CPU replicas per test module (threads are reused)."""
    if n not in _STRATEGIES:
        _STRATEGIES[n] = td.MirroredStrategy([f"cpu:{k}" for k in range(n)])
    return _STRATEGIES[n]


def close(value: torch.Tensor, expected: float) -> None:
    assert value.dtype == torch.float32 and value.dim() == 0 and value.device.type == "cpu"
    assert value.item() == pytest.approx(expected, abs=1e-6)


# -- no strategy: hand-computed values --------------------------------------------------------


def test_mean_weighted_numpy_python_and_empty():
    m = metrics.Mean()
    m.update_state(torch.tensor([1.0, 2.0, 3.0]))
    close(m.result(), 2.0)
    m.update_state(np.array([4.0, 10.0]), sample_weight=np.array([1.0, 0.0]))
    close(m.result(), 2.5)  # (6 + 4) / 4
    m.update_state(5)  # a Python number is one element
    close(m.result(), 3.0)  # 15 / 5
    m.update_state(torch.zeros(0))
    m.update_state(torch.zeros(0, 3), sample_weight=torch.zeros(0))
    close(m.result(), 3.0)
    # per-sample weights broadcast over the other dims: total 1*2+3*4... count 2*(1+3)
    w = metrics.Mean()
    w.update_state([[1.0, 1.0], [2.0, 2.0]], sample_weight=[1.0, 3.0])
    close(w.result(), 7.0 / 4.0)
    w.update_state([[0.0, 0.0]], sample_weight=[[2.0]])  # (B, 1) weights are squeezed
    close(w.result(), 14.0 / 12.0)


def test_sum_call_reset_and_empty_result():
    s = metrics.Sum()
    close(s.result(), 0.0)
    close(s([1.0, 2.0], sample_weight=[2.0, 0.5]), 3.0)
    close(s(torch.ones(2, 2)), 7.0)
    s.reset_state()
    close(s.result(), 0.0)
    m = metrics.Mean()
    close(m.result(), 0.0)  # nothing counted: 0, not nan (Keras' divide_no_nan)
    m.update_state([1.0])
    m.reset_states()
    close(m.result(), 0.0)


def test_accuracy_metrics():
    acc = metrics.Accuracy()
    acc.update_state([1, 2, 3, 4], torch.tensor([[0], [2], [3], [4]]))  # (B, 1) squeezed
    close(acc.result(), 0.75)
    acc.update_state([1, 1], [0, 0], sample_weight=[3.0, 1.0])
    close(acc.result(), 3.0 / 8.0)

    sparse = metrics.SparseCategoricalAccuracy()
    logits = torch.tensor([[0.1, 0.6, 0.3], [2.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
    sparse.update_state(torch.tensor([1, 0, 0]), logits)
    close(sparse.result(), 2.0 / 3.0)
    sparse.update_state(torch.tensor([[2], [2], [2]]), logits, sample_weight=[1.0, 1.0, 2.0])
    close(sparse.result(), 4.0 / 7.0)  # (2 + 2) / (3 + 4)
    sparse.update_state(torch.zeros(0, dtype=torch.long), torch.zeros(0, 3))
    close(sparse.result(), 4.0 / 7.0)

    cat = metrics.CategoricalAccuracy()
    cat.update_state([[0, 0, 1], [0, 1, 0]], [[0.1, 0.9, 0.8], [0.05, 0.95, 0.0]])
    close(cat.result(), 0.5)
    cat.update_state([[1, 0, 0]], [[0.9, 0.1, 0.0]], sample_weight=[2.0])
    close(cat.result(), 0.75)


def test_regression_metrics_average_per_sample_means():
    y_true = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 1.0]])
    y_pred = torch.tensor([[1.0, 1.0], [2.0, 0.0], [1.0, 4.0]])
    mae = metrics.MeanAbsoluteError()
    mae.update_state(y_true, y_pred)
    close(mae.result(), (0.5 + 1.0 + 1.5) / 3)
    mse = metrics.MeanSquaredError()
    mse.update_state(y_true, y_pred, sample_weight=[1.0, 2.0, 1.0])
    close(mse.result(), (0.5 + 2 * 2.0 + 4.5) / 4)
    flat = metrics.MeanSquaredError()
    flat.update_state([1.0, 2.0], [[1.0], [4.0]])  # 1-D targets: one value per sample
    close(flat.result(), 2.0)


def test_bad_inputs_are_clear_errors():
    with pytest.raises(InvalidArgumentError, match="do not match"):
        metrics.MeanAbsoluteError().update_state(torch.zeros(3), torch.zeros(2))
    with pytest.raises(InvalidArgumentError, match="sample_weight"):
        metrics.Mean().update_state(torch.zeros(3), sample_weight=torch.ones(2))
    with pytest.raises(InvalidArgumentError, match="y_true"):
        metrics.SparseCategoricalAccuracy().update_state(torch.zeros(4), torch.zeros(3, 2))
    with pytest.raises(InvalidArgumentError, match="missing keys"):
        metrics.Mean().load_state_dict({"total": 1.0})


def test_state_dict_round_trip_name_and_repr():
    m = metrics.Mean(name="loss")
    m.update_state([1.0, 2.0, 6.0])
    state = m.state_dict()
    assert set(state) == {"total", "count"} and state["total"].dtype == torch.float64
    fresh = metrics.Mean()
    fresh.load_state_dict(state)
    close(fresh.result(), 3.0)
    assert m.name == "loss" and metrics.SparseCategoricalAccuracy().name == "sparse_categorical_accuracy"
    assert repr(m) == "Mean(name='loss', replicas=1)"


def test_torch_metric_adapter_without_strategy():
    torchmetrics = pytest.importorskip("torchmetrics")
    adapter = metrics.TorchMetric(torchmetrics.MeanSquaredError())
    reference = torchmetrics.MeanSquaredError()
    for preds, target in [(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0])),
                          (torch.tensor([3.0]), torch.tensor([0.0]))]:
        adapter.update_state(preds, target)
        reference.update(preds, target)
    assert adapter.result().item() == pytest.approx(reference.compute().item())
    assert adapter.name == "mean_squared_error" and metrics.SyncOnReadMetric is metrics.TorchMetric
    adapter.reset_state()
    adapter.update_state(torch.tensor([2.0]), torch.tensor([0.0]))
    assert adapter.result().item() == pytest.approx(4.0)
    with pytest.raises(InvalidArgumentError, match="torchmetrics.Metric"):
        metrics.TorchMetric(metrics.Mean())


# -- under MirroredStrategy --------------------------------------------------------------------


def run_epoch(strategy, metric, batches):
    """Feed global batches through a distributed dataset, updating inside run."""

    def step(*args):
        metric.update_state(*args)

    for batch in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=batch if isinstance(batch, tuple) else (batch,))


def classification_batches(n_samples: int, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (n_samples,), generator=g)
    logits = torch.randn(n_samples, 3, generator=g)
    weights = torch.rand(n_samples, generator=g)
    return [
        (labels[i : i + batch], logits[i : i + batch], weights[i : i + batch])
        for i in range(0, n_samples, batch)
    ]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_mean_of_range_is_exact(n):
    strategy = mirrored(n)
    with strategy.scope():
        mean = metrics.Mean()
    batches = [torch.arange(i, i + 2, dtype=torch.float32) for i in range(0, 10, 2)]
    run_epoch(strategy, mean, batches)
    assert mean.result().item() == 4.5
    with strategy.scope():
        assert mean.result().item() == 4.5  # same read in the scope's cross-replica context


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("n_samples", [7, 9])  # last global batch of 3, and of 1 (< n)
def test_accuracy_over_ragged_dataset_matches_one_device(n, n_samples):
    batches = classification_batches(n_samples, 4)
    single = metrics.SparseCategoricalAccuracy()
    single_mae = metrics.MeanAbsoluteError()
    for labels, logits, weights in batches:
        single.update_state(labels, logits, sample_weight=weights)
        single_mae.update_state(logits.softmax(-1), logits, weights)

    strategy = mirrored(n)
    with strategy.scope():
        acc = metrics.SparseCategoricalAccuracy()
        mae = metrics.MeanAbsoluteError()

    def step(labels, logits, weights):
        acc.update_state(labels, logits, sample_weight=weights)
        mae.update_state(logits.softmax(-1), logits, weights)

    for batch in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=batch)
    assert acc.result().item() == pytest.approx(single.result().item(), abs=1e-7)
    assert mae.result().item() == pytest.approx(single_mae.result().item(), abs=1e-7)


@pytest.mark.parametrize("n", [2, 3])
def test_result_inside_run_is_global_on_every_replica(n):
    strategy = mirrored(n)
    with strategy.scope():
        total = metrics.Sum()

    def step(x):
        value = total(x)  # update then result: result merges, every replica gets the total
        return value + 0 * td.get_replica_context().replica_id_in_sync_group

    batch = torch.arange(1.0, 7.0)  # 1..6, split over the replicas
    (per_replica,) = list(strategy.experimental_distribute_dataset([batch]))
    results = strategy.experimental_local_results(strategy.run(step, args=(per_replica,)))
    assert [r.item() for r in results] == [21.0] * n

    def reset_and_read():
        total.reset_state()
        return total.result()

    # Every replica got the very same tensor, so run() returns it unwrapped.
    result = strategy.run(reset_and_read)
    assert isinstance(result, torch.Tensor) and result.item() == 0.0


def test_update_in_cross_replica_context_raises():
    strategy = mirrored(2)
    with strategy.scope():
        mean = metrics.Mean()
        with pytest.raises(ContextError, match="inside strategy.run"):
            mean.update_state(torch.ones(2))
    with pytest.raises(ContextError, match="inside strategy.run"):
        mean.update_state(torch.ones(2))  # the user's loop, outside any scope
    close(mean.result(), 0.0)
    with mirrored(1).scope():  # one replica: cross-replica update just updates it
        one = metrics.Mean()
        one.update_state(torch.tensor([2.0]))
    close(one.result(), 2.0)


def test_wrong_strategy_and_creation_inside_run_raise():
    plain = metrics.Mean()
    strategy = mirrored(2)
    with pytest.raises(ContextError, match=r"strategy.scope\(\)"):
        strategy.run(lambda: plain.update_state(torch.ones(1)))
    with pytest.raises(ContextError, match=r"strategy.scope\(\)"):
        strategy.run(lambda: metrics.Mean())


def test_state_dict_moves_across_replica_counts():
    batches = classification_batches(11, 4, seed=1)
    three = mirrored(3)
    with three.scope():
        acc = metrics.SparseCategoricalAccuracy()
    run_epoch(three, acc, batches[:2])
    expected = acc.result().item()
    state = acc.state_dict()

    two = mirrored(2)
    with two.scope():
        acc2 = metrics.SparseCategoricalAccuracy()
    acc2.load_state_dict(state)
    assert acc2.result().item() == expected
    plain = metrics.SparseCategoricalAccuracy()
    plain.load_state_dict(state)
    assert plain.result().item() == expected

    # Training goes on after the restore: totals keep adding up exactly.
    run_epoch(two, acc2, batches[2:])
    for labels, logits, weights in batches[2:]:
        plain.update_state(labels, logits, weights)
    reference = metrics.SparseCategoricalAccuracy()
    for labels, logits, weights in batches:
        reference.update_state(labels, logits, weights)
    assert acc2.result().item() == pytest.approx(reference.result().item(), abs=1e-7)
    assert plain.result().item() == pytest.approx(reference.result().item(), abs=1e-7)
    assert acc2.state_dict()["count"].item() == pytest.approx(reference.state_dict()["count"].item())


def test_torch_metric_adapter_under_two_replicas():
    torchmetrics = pytest.importorskip("torchmetrics")
    from torchmetrics.classification import BinaryAUROC, MulticlassAccuracy

    batches = classification_batches(9, 4, seed=2)  # last batch of 1: one replica gets nothing
    makers = {
        "accuracy": lambda: MulticlassAccuracy(num_classes=3, average="micro"),
        "mse": torchmetrics.MeanSquaredError,
        "auroc": BinaryAUROC,  # "cat" list states
        "max": torchmetrics.MaxMetric,  # "max" state
    }

    def feed(update):
        for labels, logits, _ in batches:
            update["accuracy"](logits, labels)
            update["mse"](logits[:, 0], labels.float())
            update["auroc"](logits[:, 0].sigmoid(), (labels == 0).long())
            update["max"](logits[:, 1])

    reference = {k: make() for k, make in makers.items()}
    feed({k: m.update for k, m in reference.items()})

    strategy = mirrored(2)
    with strategy.scope():
        adapted = {k: metrics.TorchMetric(make()) for k, make in makers.items()}

    def step(labels, logits, weights):
        feed_one = {k: m.update_state for k, m in adapted.items()}
        feed_one["accuracy"](logits, labels)
        feed_one["mse"](logits[:, 0], labels.float())
        feed_one["auroc"](logits[:, 0].sigmoid(), (labels == 0).long())
        feed_one["max"](logits[:, 1])

    for batch in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=batch)
    for key, metric in adapted.items():
        assert metric.result().item() == pytest.approx(reference[key].compute().item(), abs=1e-6), key

    # One logical copy in the state dict: loads without a strategy, same value.
    state = adapted["auroc"].state_dict()
    plain = metrics.TorchMetric(BinaryAUROC())
    plain.load_state_dict(state)
    assert plain.result().item() == pytest.approx(reference["auroc"].compute().item(), abs=1e-6)


def test_torch_metric_adapter_merges_wrapped_metrics():
    pytest.importorskip("torchmetrics")
    from torchmetrics.classification import MulticlassAccuracy
    from torchmetrics.wrappers import ClasswiseWrapper

    def make():
        return ClasswiseWrapper(MulticlassAccuracy(num_classes=3, average=None), labels=["a", "b", "c"])

    batches = classification_batches(10, 4, seed=3)
    reference = make()
    for labels, logits, _ in batches:
        reference.update(logits, labels)
    strategy = mirrored(2)
    with strategy.scope():
        adapted = metrics.TorchMetric(make())
    for labels, logits, _ in strategy.experimental_distribute_dataset(batches):
        strategy.run(adapted.update_state, args=(logits, labels))
    expected = reference.compute()
    for source in (adapted, metrics.TorchMetric(make())):
        if source is not adapted:
            source.load_state_dict(adapted.state_dict())
        result = source.result()
        assert result.keys() == expected.keys()
        for key in expected:
            assert result[key].item() == pytest.approx(expected[key].item(), abs=1e-6)
