"""compute_average_loss and scale_regularization_loss."""

from __future__ import annotations

import pytest
import torch

import torch_distribute as td

pytestmark = pytest.mark.timeout(60)


def make_strategy(n: int) -> td.MirroredStrategy:
    return td.MirroredStrategy([f"cpu:{i}" for i in range(n)])


def local(strategy, value):
    return strategy.experimental_local_results(value)


# -- no strategy -----------------------------------------------------------------------------


def test_sum_over_global_batch():
    loss = td.compute_average_loss(torch.tensor([1.0, 2.0, 3.0]), global_batch_size=6)
    assert loss.item() == 1.0
    loss = td.compute_average_loss(torch.tensor([1.0, 2.0, 3.0, 4.0]), global_batch_size=5)
    torch.testing.assert_close(loss, torch.tensor(2.0))


def test_no_global_batch_size_without_strategy():
    loss = td.compute_average_loss(torch.tensor([1.0, 2.0, 6.0]))
    torch.testing.assert_close(loss, torch.tensor(3.0))


def test_sample_weight():
    per_example = torch.tensor([1.0, 2.0, 3.0])
    weight = torch.tensor([0.5, 0.0, 2.0])
    loss = td.compute_average_loss(per_example, sample_weight=weight, global_batch_size=4)
    torch.testing.assert_close(loss, torch.tensor((0.5 + 6.0) / 4))
    loss = td.compute_average_loss(per_example, sample_weight=2.0, global_batch_size=3)
    torch.testing.assert_close(loss, torch.tensor(4.0))


def test_multi_dim_per_example_loss():
    per_example = torch.arange(6.0).reshape(3, 2)
    loss = td.compute_average_loss(per_example, global_batch_size=3)
    torch.testing.assert_close(loss, torch.tensor(15.0 / 3))


def test_zero_global_batch_is_zero_and_differentiable():
    w = torch.tensor(2.0, requires_grad=True)
    per_example = torch.zeros(0) * w
    loss = td.compute_average_loss(per_example, global_batch_size=0)
    assert loss.item() == 0.0
    loss.backward()
    assert w.grad is not None and w.grad.item() == 0.0
    # non-empty but G=0: also zero, not inf/nan
    w.grad = None
    loss = td.compute_average_loss(torch.ones(2) * w, global_batch_size=0)
    assert loss.item() == 0.0
    loss.backward()
    assert w.grad.item() == 0.0


def test_gradient_matches_mean():
    w = torch.tensor([1.0, -2.0], requires_grad=True)
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    td.compute_average_loss((x @ w) ** 2, global_batch_size=3).backward()
    w2 = w.detach().clone().requires_grad_()
    ((x @ w2) ** 2).mean().backward()
    torch.testing.assert_close(w.grad, w2.grad)


def test_scalar_loss_rejected():
    with pytest.raises(td.InvalidArgumentError, match="reduction='none'"):
        td.compute_average_loss(torch.tensor(1.0), global_batch_size=2)


@pytest.mark.parametrize("bad", [-1, -10])
def test_negative_global_batch(bad):
    with pytest.raises(td.InvalidArgumentError):
        td.compute_average_loss(torch.ones(2), global_batch_size=bad)


@pytest.mark.parametrize("bad", [2.0, 2.5, "4", True, torch.tensor(4.0), [4]])
def test_non_int_global_batch(bad):
    with pytest.raises(td.InvalidArgumentError):
        td.compute_average_loss(torch.ones(2), global_batch_size=bad)


def test_int_tensor_global_batch_accepted():
    loss = td.compute_average_loss(torch.ones(2), global_batch_size=torch.tensor(4))
    torch.testing.assert_close(loss, torch.tensor(0.5))


def test_scale_regularization_loss_no_strategy():
    assert td.scale_regularization_loss(torch.tensor([1.0, 2.0])).item() == 3.0
    assert td.scale_regularization_loss([torch.tensor(1.0), torch.tensor([2.0, 3.0])]).item() == 6.0


# -- inside a strategy --------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3])
def test_compute_average_loss_in_replicas(n):
    strategy = make_strategy(n)
    per_example = torch.arange(1.0, 8.0)  # 7 examples
    (dist,) = list(strategy.experimental_distribute_dataset([per_example]))
    out = strategy.run(lambda v: td.compute_average_loss(v, global_batch_size=7), args=(dist,))
    sizes = [v.shape[0] for v in local(strategy, dist)]
    for v, part in zip(local(strategy, out), torch.split(per_example, sizes), strict=True):
        torch.testing.assert_close(v, part.sum() / 7)
    torch.testing.assert_close(strategy.reduce("sum", out, axis=None), per_example.mean())


@pytest.mark.filterwarnings("ignore:td.compute_average_loss.. without global_batch_size")  # uneven on purpose
@pytest.mark.parametrize("n", [1, 2, 3])
def test_compute_average_loss_default_batch_is_local_times_n(n):
    strategy = make_strategy(n)

    def fn():
        r = td.get_replica_context().replica_id_in_sync_group
        per_example = torch.full((r + 2,), 6.0)
        return td.compute_average_loss(per_example)

    out = strategy.run(fn)
    for r, v in enumerate(local(strategy, out)):
        torch.testing.assert_close(v, torch.tensor(6.0 * (r + 2) / ((r + 2) * n)))


def test_compute_average_loss_two_replicas_no_g():
    strategy = make_strategy(2)
    (dist,) = list(strategy.experimental_distribute_dataset([torch.tensor([1.0, 2.0, 3.0, 4.0])]))
    out = strategy.run(td.compute_average_loss, args=(dist,))
    assert [v.item() for v in local(strategy, out)] == [3.0 / 4, 7.0 / 4]
    assert strategy.reduce("sum", out, axis=None).item() == 2.5


def test_a_global_batch_size_below_the_steps_rows_is_refused():
    # A dataset of global batches of 8 while global_batch_size counts 4 (a per-worker habit):
    # every example would weigh twice what one device gives it.
    strategy = make_strategy(2)
    (dist,) = list(strategy.experimental_distribute_dataset([torch.arange(8.0)]))
    with pytest.raises(td.LossScalingError, match=r"global_batch_size=4\) on a step whose batches hold 8 rows"):
        strategy.run(lambda v: td.compute_average_loss(v, global_batch_size=4), args=(dist,))


def test_counts_of_their_own_are_not_checked_against_the_steps_rows(recwarn):
    """A per-token loss divided by the tokens (more than the rows), and a masked batch's loss
    divided by its valid rows counted in the step (fewer than the rows): neither is refused
    nor warned about."""
    import warnings

    strategy = make_strategy(2)
    dist = strategy.experimental_distribute_dataset([torch.ones(8, 3), torch.ones(8, 3), torch.ones(4, 3)])
    warnings.simplefilter("error")
    for batch in dist:
        per_token = strategy.run(lambda v: td.compute_average_loss(v, global_batch_size=v.shape[0] * 2 * 3),
                                 args=(batch,))
        assert strategy.reduce("sum", per_token, axis=None).item() == pytest.approx(1.0)
    (rows,) = list(strategy.experimental_distribute_dataset([torch.arange(8.0)]))

    def masked(v):
        valid = torch.tensor(3)  # as an all-reduced count of the valid rows would be
        return td.compute_average_loss(v * (v < 3), global_batch_size=valid)

    out = strategy.run(masked, args=(rows,))
    assert strategy.reduce("sum", out, axis=None).item() == pytest.approx(1.0)


def test_the_guess_on_an_unevenly_split_last_batch_warns_and_divides_as_tensorflow():
    # 3 rows over 2 replicas: 2 and 1. Without global_batch_size TensorFlow divides each
    # replica's sum by its rows x 2 (4 and 2); this is kept, with a warning, and not refused
    # although replica 1's guess (2) is below the step's 3 rows.
    strategy = make_strategy(2)
    (dist,) = list(strategy.experimental_distribute_dataset([torch.tensor([1.0, 2.0, 3.0])]))
    with pytest.warns(UserWarning, match="this step's global batch has 3 rows"):
        out = strategy.run(td.compute_average_loss, args=(dist,))
    assert [v.item() for v in local(strategy, out)] == [3.0 / 4, 3.0 / 2]


def test_a_short_step_that_is_not_the_last_warns():
    strategy = make_strategy(2)
    dist = strategy.experimental_distribute_dataset([torch.ones(8), torch.ones(4), torch.ones(8)])
    with pytest.warns(UserWarning, match="at step 1 of this epoch, whose batches held 4 rows") as caught:
        for batch in dist:
            strategy.run(lambda v: td.compute_average_loss(v, global_batch_size=8), args=(batch,))
    assert len([w for w in caught if "weighed 1/8 instead of 1/4" in str(w.message)]) == 1


def test_empty_replica_contributes_zero():
    strategy = make_strategy(3)
    (dist,) = list(strategy.experimental_distribute_dataset([torch.tensor([5.0])]))
    out = strategy.run(lambda v: td.compute_average_loss(v, global_batch_size=1), args=(dist,))
    assert [v.item() for v in local(strategy, out)] == [5.0, 0.0, 0.0]


def test_sample_weight_in_replicas():
    strategy = make_strategy(2)
    batch = (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 0.0, 2.0]))
    (dist,) = list(strategy.experimental_distribute_dataset([batch]))
    out = strategy.run(
        lambda loss, w: td.compute_average_loss(loss, sample_weight=w, global_batch_size=3),
        args=dist)
    torch.testing.assert_close(strategy.reduce("sum", out, axis=None), torch.tensor(7.0 / 3))


@pytest.mark.parametrize("n", [1, 2])
def test_cross_replica_context_raises(n):
    strategy = make_strategy(n)
    with strategy.scope():
        with pytest.raises(td.ContextError, match="cross-replica"):
            td.compute_average_loss(torch.ones(2), global_batch_size=2)
        with pytest.raises(td.ContextError, match="cross-replica"):
            td.scale_regularization_loss(torch.ones(2))


def test_merge_fn_is_cross_replica():
    strategy = make_strategy(2)

    def merge_fn(_s):
        return td.compute_average_loss(torch.ones(2), global_batch_size=2)

    with pytest.raises(td.ContextError):
        strategy.run(lambda: td.get_replica_context().merge_call(merge_fn))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_scale_regularization_loss(n):
    strategy = make_strategy(n)

    def fn():
        tensor = td.scale_regularization_loss(torch.tensor([1.0, 2.0, 3.0]))
        listed = td.scale_regularization_loss([torch.tensor(4.0), torch.tensor([1.0, 1.0])])
        return tensor, listed

    tensor, listed = strategy.run(fn)
    for v in local(strategy, tensor):
        torch.testing.assert_close(v, torch.tensor(6.0 / n))
    for v in local(strategy, listed):
        torch.testing.assert_close(v, torch.tensor(6.0 / n))
    torch.testing.assert_close(strategy.reduce("sum", tensor, axis=None), torch.tensor(6.0))


def test_scale_regularization_loss_gradient():
    strategy = make_strategy(2)
    with strategy.scope():
        layer = torch.nn.Linear(2, 1, bias=False)
        opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    with torch.no_grad():
        layer.weight.fill_(1.0)

    def step():
        reg = td.scale_regularization_loss(layer.weight.pow(2).sum())
        reg.backward()
        opt.step()
        opt.zero_grad()

    strategy.run(step)
    # d/dw sum(w^2) = 2w = 2, counted once after the SUM over replicas: w = 1 - 2 = -1
    for c in strategy.experimental_local_results(layer.weight):
        assert torch.equal(c, torch.full((1, 2), -1.0))


def test_sample_weight_column_vector():
    per_example = torch.tensor([1.0, 2.0, 3.0])
    weight = torch.tensor([[1.0], [0.0], [0.0]])
    loss = td.compute_average_loss(per_example, sample_weight=weight, global_batch_size=3)
    torch.testing.assert_close(loss, torch.tensor(1.0 / 3))
    loss = td.compute_average_loss(per_example.unsqueeze(1), sample_weight=weight.squeeze(1),
                                   global_batch_size=3)
    torch.testing.assert_close(loss, torch.tensor(1.0 / 3))


def test_keras_losses_take_reduction():
    y_true, y_pred = torch.tensor([0, 1]), torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    per_row = td.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")(y_true, y_pred)
    assert per_row.shape == (2,)
    for reduction, want in (("sum_over_batch_size", per_row.mean()), ("auto", per_row.mean()), ("sum", per_row.sum()),
                            (td.keras.losses.Reduction.NONE, per_row), (None, per_row)):
        loss = td.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
        torch.testing.assert_close(loss(y_true, y_pred), want)
    weighted = td.keras.losses.MeanSquaredError(reduction="sum")(torch.zeros(2, 1), torch.ones(2, 1), sample_weight=[1.0, 3.0])
    assert float(weighted) == 4.0
    with pytest.raises(td.InvalidArgumentError, match="reduction must be 'sum_over_batch_size'"):
        td.keras.losses.Huber(reduction="mean")
    model = td.keras.Model(torch.nn.Linear(2, 1))
    with pytest.raises(td.InvalidArgumentError, match="fit averages every loss over the global batch"):
        model.compile("sgd", td.keras.losses.MeanSquaredError(reduction="sum"))
