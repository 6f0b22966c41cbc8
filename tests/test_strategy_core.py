"""The replica model: run, merge_call, contexts, reductions, mirrored state, errors."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import torch_distribute as td

pytestmark = pytest.mark.timeout(60)

NUM_REPLICAS = [1, 2, 3]


def make_strategy(n: int) -> td.MirroredStrategy:
    return td.MirroredStrategy([f"cpu:{i}" for i in range(n)])


@pytest.fixture(params=NUM_REPLICAS, ids=lambda n: f"N{n}")
def strategy(request):
    return make_strategy(request.param)


@pytest.fixture(params=[2, 3], ids=lambda n: f"N{n}")
def multi(request):
    return make_strategy(request.param)


def replica_id() -> int:
    return td.get_replica_context().replica_id_in_sync_group


def local(strategy, value):
    return strategy.experimental_local_results(value)


# -- run: results --------------------------------------------------------------------------


def test_run_returns_per_replica(strategy):
    n = strategy.num_replicas_in_sync
    out = strategy.run(lambda: torch.tensor(float(replica_id())))
    if n > 1:
        assert isinstance(out, td.PerReplica)
        assert len(out.values) == n
    values = local(strategy, out)
    assert [float(v) for v in values] == [float(i) for i in range(n)]


def test_run_same_object_is_plain_unless_it_can_be_reduced(strategy):
    """An object every replica returns stays plain; a tensor or a number from each replica is a
    PerReplica even when it is one object (unless the strategy mirrored it: a captured
    parameter), so reducing it never depends on object identity."""
    sentinel = object()
    tensor = torch.ones(2)
    out = strategy.run(lambda: (sentinel, tensor, None))
    assert out[0] is sentinel
    assert out[2] is None
    if strategy.num_replicas_in_sync == 1:
        assert out[1] is tensor
        return
    assert isinstance(out[1], td.PerReplica) and all(v is tensor for v in out[1].values)
    torch.testing.assert_close(strategy.reduce("sum", out[1], axis=None), strategy.num_replicas_in_sync * tensor)
    with strategy.scope():
        layer = nn.Linear(2, 1)
    assert strategy.run(lambda: layer.weight) is layer.weight


@pytest.mark.parametrize("rows", [32, 300])  # CPython caches ints up to 256: one object, or two
def test_reduce_of_python_numbers_returned_by_replicas_is_exact(strategy, rows):
    n = strategy.num_replicas_in_sync
    (batch,) = list(strategy.experimental_distribute_dataset([torch.zeros(n * rows, 3)]))
    out = strategy.run(lambda x: x.shape[0], args=(batch,))
    if n > 1:
        assert isinstance(out, td.PerReplica) and out.values == (rows,) * n
    total = strategy.reduce("sum", out, axis=None)
    assert total.dtype == torch.int64 and total.item() == n * rows
    assert strategy.reduce("mean", out, axis=None).item() == rows
    # Floats are summed in float64: the exact sum of what the replicas returned.
    tenth = strategy.reduce("sum", strategy.run(lambda: 0.1), axis=None)
    assert tenth.dtype == torch.float64 and tenth.item() == sum([0.1] * n)
    flags = strategy.reduce("sum", strategy.run(lambda: True), axis=None)
    assert flags.item() == n  # counted, not or-ed


def test_run_nests(strategy):
    n = strategy.num_replicas_in_sync
    shared = torch.zeros(1)

    def fn():
        r = replica_id()
        return {"loss": torch.tensor(float(r)), "pair": (r, [r * 10, shared])}

    out = strategy.run(fn)
    assert isinstance(out, dict) and set(out) == {"loss", "pair"}
    assert isinstance(out["pair"], tuple) and isinstance(out["pair"][1], list)
    assert all(v is shared for v in local(strategy, out["pair"][1][1]))  # one object, n replicas
    assert [float(v) for v in local(strategy, out["loss"])] == list(range(n))
    assert list(local(strategy, out["pair"][0])) == list(range(n))
    assert list(local(strategy, out["pair"][1][0])) == [10 * i for i in range(n)]
    if n > 1:
        assert isinstance(out["loss"], td.PerReplica)
        assert isinstance(out["pair"][1][0], td.PerReplica)


def test_run_args_and_kwargs_are_split(strategy):
    n = strategy.num_replicas_in_sync
    per_replica = td.PerReplica([torch.tensor(float(i)) for i in range(n)]) if n > 1 else torch.tensor(0.0)
    common = torch.tensor(100.0)
    out = strategy.run(lambda a, b, scale=1: (a + b) * scale, args=(per_replica, common),
                       kwargs={"scale": 2})
    assert [float(v) for v in local(strategy, out)] == [2 * (100 + i) for i in range(n)]


@pytest.mark.parametrize(
    "returns",
    [
        pytest.param(lambda r: (1, 2) if r == 0 else (1, 2, 3), id="tuple_len"),
        pytest.param(lambda r: {"a": 1} if r == 0 else {"b": 1}, id="dict_keys"),
        pytest.param(lambda r: torch.ones(1) if r == 0 else (torch.ones(1),), id="tensor_vs_tuple"),
        pytest.param(lambda r: [1, 2] if r == 0 else (1, 2), id="list_vs_tuple"),
    ],
)
def test_mismatched_nests(multi, returns):
    with pytest.raises(td.ReplicaMismatchError, match="structure"):
        multi.run(lambda: returns(replica_id()))
    # the strategy is still usable
    assert list(local(multi, multi.run(replica_id))) == list(range(multi.num_replicas_in_sync))


# -- run: errors ------------------------------------------------------------------------------


class Boom(Exception):
    pass


def test_exception_in_fn_propagates(strategy):
    def fn():
        raise Boom(f"replica {replica_id()}")

    with pytest.raises(Boom, match="replica"):
        strategy.run(fn)
    n = strategy.num_replicas_in_sync
    assert list(local(strategy, strategy.run(replica_id))) == list(range(n))


def test_exception_in_one_replica_while_others_merge(multi):
    n = multi.num_replicas_in_sync

    def fn():
        ctx = td.get_replica_context()
        if ctx.replica_id_in_sync_group == n - 1:
            raise Boom("last replica")
        return ctx.all_reduce("sum", torch.tensor(1.0))

    with pytest.raises(Boom, match="last replica"):
        multi.run(fn)
    out = multi.run(lambda: td.get_replica_context().all_reduce("sum", torch.tensor(1.0)))
    assert all(float(v) == n for v in local(multi, out))


def test_exception_in_merge_fn_propagates(strategy):
    def merge_fn(_strategy):
        raise KeyError("from merge")

    with pytest.raises(KeyError, match="from merge"):
        strategy.run(lambda: td.get_replica_context().merge_call(merge_fn))
    n = strategy.num_replicas_in_sync
    assert list(local(strategy, strategy.run(replica_id))) == list(range(n))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("pattern", ["one_vs_none", "two_vs_one", "all_reduce_only_on_0"])
def test_different_number_of_merge_calls(multi, pattern):
    def fn():
        ctx = td.get_replica_context()
        r = ctx.replica_id_in_sync_group
        if pattern == "one_vs_none":
            if r == 0:
                ctx.merge_call(lambda s: None)
        elif pattern == "two_vs_one":
            ctx.merge_call(lambda s: None)
            if r == 1:
                ctx.merge_call(lambda s: None)
        else:
            if r == 0:
                ctx.all_reduce("sum", torch.tensor(1.0))
        return r

    with pytest.raises(td.ReplicaMismatchError, match="merge_call"):
        multi.run(fn)
    # no thread is left stuck: the next run works
    assert list(local(multi, multi.run(replica_id))) == list(range(multi.num_replicas_in_sync))


# -- merge_call ---------------------------------------------------------------------------


def test_merge_call_semantics(strategy):
    n = strategy.num_replicas_in_sync
    seen = []
    shared = torch.tensor(5.0)

    def merge_fn(s, value, same, *, extra):
        seen.append((s, value, same, extra, td.in_cross_replica_context(),
                     td.get_replica_context(), td.get_strategy(), threading.get_ident()))
        values = local(s, value)
        total = sum(float(v) for v in values)
        return td.PerReplica([total + 10 * k for k in range(n)]) if n > 1 else total, "plain"

    def fn():
        r = replica_id()
        ctx = td.get_replica_context()
        mine, plain = ctx.merge_call(merge_fn, args=(torch.tensor(float(r)), shared),
                                     kwargs={"extra": r * 2})
        assert not td.in_cross_replica_context()
        return mine, plain

    out = strategy.run(fn)
    assert len(seen) == 1
    s, value, same, extra, cross, rctx, current, _ = seen[0]
    assert s is strategy
    assert cross is True
    assert rctx is None
    assert current is strategy
    # One tensor object from every replica is still one value per replica (never identity).
    assert all(v is shared for v in local(strategy, same))
    if n > 1:
        assert isinstance(value, td.PerReplica)
        assert [float(v) for v in value.values] == list(range(n))
        assert isinstance(extra, td.PerReplica) and list(extra.values) == [2 * k for k in range(n)]
    total = sum(range(n))
    assert list(local(strategy, out[0])) == [total + 10 * k for k in range(n)]
    assert out[1] == "plain"


def test_merge_call_args_must_be_tuple(strategy):
    def fn():
        return td.get_replica_context().merge_call(lambda s, x: x, args=torch.ones(1))

    with pytest.raises(td.InvalidArgumentError, match="tuple"):
        strategy.run(fn)


def test_merge_call_args_must_be_tuple_default_context():
    with pytest.raises(td.InvalidArgumentError, match="tuple"):
        td.get_replica_context().merge_call(lambda s, x: x, args=[1])
    assert td.get_replica_context().merge_call(lambda s, x: x + 1, args=(1,)) == 2


# -- cross-replica-only calls, scopes ------------------------------------------------------


def test_reduce_inside_run_raises(strategy):
    def fn():
        return strategy.reduce("sum", torch.ones(1), axis=None)

    with pytest.raises(td.ContextError, match="merge_call") as info:
        strategy.run(fn)
    assert isinstance(info.value, RuntimeError)


def test_gather_inside_run_raises(strategy):
    with pytest.raises(RuntimeError, match="all_gather") as info:
        strategy.run(lambda: strategy.gather(torch.ones(1), axis=0))
    assert isinstance(info.value, td.ContextError)


def test_reduce_via_merge_call_works(strategy):
    n = strategy.num_replicas_in_sync

    def fn():
        value = torch.tensor(float(replica_id() + 1))
        return td.get_replica_context().merge_call(
            lambda s, v: s.reduce("sum", v, axis=None), args=(value,))

    out = strategy.run(fn)
    assert float(local(strategy, out)[0]) == n * (n + 1) / 2


def test_run_inside_run_raises(strategy):
    with pytest.raises(td.ContextError):
        strategy.run(lambda: strategy.run(lambda: 1))


def test_other_strategy_scope_inside_scope():
    a, b = make_strategy(2), make_strategy(1)
    with a.scope():
        with pytest.raises(td.ContextError, match="strateg"):
            with b.scope():
                pass
        # same strategy may be re-entered
        with a.scope():
            assert td.get_strategy() is a
        assert td.get_strategy() is a
    assert not td.has_strategy()


@pytest.mark.parametrize("other", [lambda: make_strategy(2), lambda: td.OneDeviceStrategy("cpu")])
def test_other_strategy_scope_inside_run(strategy, other):
    b = other()

    def fn():
        with b.scope():
            pass

    with pytest.raises(td.ContextError, match="strateg"):
        strategy.run(fn)


def test_own_scope_inside_run_keeps_replica_context(strategy):
    def fn():
        with strategy.scope():
            return replica_id(), td.in_cross_replica_context()

    ids, cross = strategy.run(fn)
    assert list(local(strategy, ids)) == list(range(strategy.num_replicas_in_sync))
    assert not any(local(strategy, cross))


def test_context_functions(strategy):
    n = strategy.num_replicas_in_sync
    # no strategy
    assert not td.has_strategy()
    assert not td.in_cross_replica_context()
    default = td.get_strategy()
    assert default is not strategy and default.num_replicas_in_sync == 1
    ctx = td.get_replica_context()
    assert ctx is not None and ctx.replica_id_in_sync_group == 0 and ctx.num_replicas_in_sync == 1
    # in scope, outside run
    with strategy.scope():
        assert td.has_strategy()
        assert td.get_strategy() is strategy
        assert td.in_cross_replica_context()
        assert td.get_replica_context() is None
        out = strategy.run(lambda: (
            td.get_replica_context().replica_id_in_sync_group,
            td.get_replica_context().num_replicas_in_sync,
            td.get_replica_context().strategy is strategy,
            td.get_strategy() is strategy,
            td.has_strategy(),
            td.in_cross_replica_context(),
        ))
        assert td.get_replica_context() is None
    ids, nums, same_strategy, current, has, cross = out
    assert list(local(strategy, ids)) == list(range(n))
    assert all(v == n for v in local(strategy, nums))
    assert all(local(strategy, same_strategy)) and all(local(strategy, current)) and all(local(strategy, has))
    assert not any(local(strategy, cross))
    # run outside scope: same contexts inside
    ids = strategy.run(lambda: (replica_id(), td.get_strategy() is strategy))
    assert list(local(strategy, ids[0])) == list(range(n)) and all(local(strategy, ids[1]))
    assert not td.has_strategy() and td.get_strategy() is default


def test_default_strategy_roundtrip():
    default = td.get_strategy()
    out = default.run(lambda x: x * 2, args=(torch.tensor(3.0),))
    assert torch.equal(out, torch.tensor(6.0))
    assert torch.equal(default.reduce("sum", out, axis=None), torch.tensor(6.0))
    assert default.experimental_local_results(out) == (out,)


# -- all_reduce / all_gather ---------------------------------------------------------------


def test_all_reduce_sum_mean(strategy):
    n = strategy.num_replicas_in_sync

    def fn():
        ctx = td.get_replica_context()
        r = ctx.replica_id_in_sync_group
        x = torch.tensor([float(r), 2.0 * r + 1])
        return (ctx.all_reduce(td.ReduceOp.SUM, x), ctx.all_reduce("mean", x),
                ctx.all_reduce("sum", {"k": [x, torch.tensor(r)]}))

    s, m, nested = strategy.run(fn)
    expected_sum = torch.tensor([float(sum(range(n))), float(sum(2 * r + 1 for r in range(n)))])
    for v in local(strategy, s):
        assert torch.equal(v, expected_sum)
    for v in local(strategy, m):
        torch.testing.assert_close(v, expected_sum / n, atol=0, rtol=0)
    for v in local(strategy, nested["k"][0]):
        assert torch.equal(v, expected_sum)
    for v in local(strategy, nested["k"][1]):
        assert int(v) == sum(range(n))


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_all_reduce_gradient(strategy, op):
    """d/dx_r of sum_s c_s * all_reduce(x_s * w_s) is w_r * sum_s c_s (/N for MEAN)."""
    n = strategy.num_replicas_in_sync

    def fn():
        ctx = td.get_replica_context()
        r = ctx.replica_id_in_sync_group
        x = (torch.tensor([1.0, 2.0]) * (r + 1)).requires_grad_()
        w = float(r + 2)
        y = ctx.all_reduce(op, x * w)
        loss = (y * float(r + 1)).sum()
        loss.backward()
        return x.grad, y.detach()

    grads, ys = strategy.run(fn)
    sum_c = sum(r + 1 for r in range(n))
    expected_y = sum(torch.tensor([1.0, 2.0]) * (r + 1) * (r + 2) for r in range(n))
    if op == "mean":
        expected_y = expected_y / n
    for r, (g, y) in enumerate(zip(local(strategy, grads), local(strategy, ys), strict=True)):
        expected_g = torch.full((2,), float((r + 2) * sum_c))
        if op == "mean":
            expected_g = expected_g / n
        torch.testing.assert_close(g, expected_g, atol=0, rtol=0)
        torch.testing.assert_close(y, expected_y, atol=0, rtol=0)


def test_all_gather_uneven(strategy):
    n = strategy.num_replicas_in_sync

    def fn():
        ctx = td.get_replica_context()
        r = ctx.replica_id_in_sync_group
        rows = torch.full((r + 1, 2), float(r))
        cols = torch.full((2, r), float(r))
        return ctx.all_gather(rows, 0), ctx.all_gather(cols, axis=1), ctx.all_gather(torch.tensor(r), 0)

    rows, cols, scalars = strategy.run(fn)
    expected_rows = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(n)])
    expected_cols = torch.cat([torch.full((2, r), float(r)) for r in range(n)], dim=1)
    for v in local(strategy, rows):
        assert torch.equal(v, expected_rows)
    for v in local(strategy, cols):
        assert torch.equal(v, expected_cols)
    for v in local(strategy, scalars):
        assert torch.equal(v, torch.arange(n))


def test_all_gather_gradient(multi):
    n = multi.num_replicas_in_sync

    def fn():
        ctx = td.get_replica_context()
        r = ctx.replica_id_in_sync_group
        x = torch.ones(r + 1, requires_grad=True)
        g = ctx.all_gather(x * 1.0, 0)
        (g * float(r + 1)).sum().backward()
        return x.grad

    grads = local(multi, multi.run(fn))
    sum_c = float(sum(r + 1 for r in range(n)))
    for r, g in enumerate(grads):
        assert torch.equal(g, torch.full((r + 1,), sum_c))


def test_all_gather_bad_axis(strategy):
    with pytest.raises(td.InvalidAxisError):
        strategy.run(lambda: td.get_replica_context().all_gather(torch.ones(2, 2), 2))


# -- reduce / gather ---------------------------------------------------------------------------


def per_replica_of(strategy, values):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: values[ctx.replica_id_in_sync_group])


def test_reduce_axis_none(strategy):
    n = strategy.num_replicas_in_sync
    value = per_replica_of(strategy, [torch.tensor([float(r), 1.0]) for r in range(n)])
    expected = torch.tensor([float(sum(range(n))), float(n)])
    assert torch.equal(strategy.reduce("sum", value, axis=None), expected)
    torch.testing.assert_close(strategy.reduce(td.ReduceOp.MEAN, value, axis=None), expected / n,
                               atol=0, rtol=0)
    # nests of per-replica values
    out = strategy.reduce("sum", {"a": value, "b": [value]}, axis=None)
    assert torch.equal(out["a"], expected) and torch.equal(out["b"][0], expected)


def test_reduce_result_is_detached(strategy):
    with strategy.scope():
        layer = nn.Linear(2, 1)
    out = strategy.run(lambda: layer(torch.ones(1, 2)).sum())
    assert not strategy.reduce("sum", out, axis=None).requires_grad


def distribute_one_batch(strategy, batch):
    return next(iter(strategy.experimental_distribute_dataset([batch])))


@pytest.mark.parametrize("global_batch", [5, 1, 7, 2])
def test_reduce_axis0_exact_with_uneven_and_empty(strategy, global_batch):
    x = torch.arange(global_batch * 2, dtype=torch.float32).reshape(global_batch, 2) ** 2
    dist = distribute_one_batch(strategy, x)
    sizes = [v.shape[0] for v in local(strategy, dist)]
    assert sum(sizes) == global_batch
    torch.testing.assert_close(strategy.reduce("mean", dist, axis=0), x.mean(0))
    torch.testing.assert_close(strategy.reduce("sum", dist, axis=0), x.sum(0))
    torch.testing.assert_close(strategy.reduce("mean", dist, axis=-2), x.mean(0))
    # the same through run: per-example values
    out = strategy.run(lambda b: b.sum(1), args=(dist,))
    torch.testing.assert_close(strategy.reduce("mean", out, axis=0), x.sum(1).mean())


def test_reduce_axis0_five_over_three():
    strategy = make_strategy(3)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0])
    dist = distribute_one_batch(strategy, x)
    assert [v.shape[0] for v in local(strategy, dist)] == [2, 2, 1]
    assert float(strategy.reduce("mean", dist, axis=0)) == 4.0
    one = distribute_one_batch(strategy, torch.tensor([7.0]))
    assert [v.shape[0] for v in local(strategy, one)] == [1, 0, 0]
    assert float(strategy.reduce("mean", one, axis=0)) == 7.0
    assert float(strategy.reduce("sum", one, axis=0)) == 7.0


@pytest.mark.parametrize("axis", [2, -3, 5])
def test_reduce_axis_out_of_range(strategy, axis):
    value = per_replica_of(strategy, [torch.ones(2, 3)] * strategy.num_replicas_in_sync)
    with pytest.raises(td.InvalidAxisError, match="out of range"):
        strategy.reduce("sum", value, axis=axis)
    with pytest.raises(td.InvalidAxisError):
        strategy.gather(value, axis=axis)


def test_reduce_axis_on_scalars(strategy):
    value = per_replica_of(strategy, [torch.tensor(1.0)] * strategy.num_replicas_in_sync)
    with pytest.raises(td.InvalidAxisError):
        strategy.reduce("mean", value, axis=0)


@pytest.mark.parametrize("axis", ["0", 0.0, True, [0]])
def test_reduce_axis_not_int(strategy, axis):
    value = per_replica_of(strategy, [torch.ones(2)] * strategy.num_replicas_in_sync)
    with pytest.raises(td.InvalidAxisError):
        strategy.reduce("sum", value, axis=axis)
    with pytest.raises(td.InvalidAxisError):
        strategy.gather(value, axis=axis)


def test_sum_of_non_distributed_tensor(multi):
    with pytest.raises(td.InvalidArgumentError, match="not a distributed value"):
        multi.reduce("sum", torch.ones(2), axis=None)
    # MEAN of a plain value is the value itself
    assert torch.equal(multi.reduce("mean", torch.ones(2), axis=None), torch.ones(2))


def test_sum_of_plain_tensor_one_replica():
    strategy = make_strategy(1)
    assert torch.equal(strategy.reduce("sum", torch.ones(2), axis=None), torch.ones(2))


def test_gather_in_replica_order(strategy):
    n = strategy.num_replicas_in_sync
    parts = [torch.full((r + 1, 2), float(r)) for r in range(n)]
    value = per_replica_of(strategy, parts)
    assert torch.equal(strategy.gather(value, 0), torch.cat(parts))
    assert torch.equal(strategy.gather(value, -2), torch.cat(parts))
    col_parts = [p.t() for p in parts]
    assert torch.equal(strategy.gather(per_replica_of(strategy, col_parts), 1), torch.cat(col_parts, 1))
    scalars = strategy.run(lambda: torch.tensor(float(replica_id())))
    assert torch.equal(strategy.gather(scalars, 0), torch.arange(n, dtype=torch.float32))


# -- local results -------------------------------------------------------------------------


def test_local_results_kinds(strategy):
    n = strategy.num_replicas_in_sync
    pr = td.PerReplica(tuple(range(n)))
    assert strategy.experimental_local_results(pr) == tuple(range(n))
    assert strategy.experimental_local_results(5) == (5,)
    plain = torch.ones(2)
    assert strategy.experimental_local_results(plain)[0] is plain
    assert len(strategy.experimental_local_results(plain)) == 1
    loose = nn.Linear(2, 2)
    assert strategy.experimental_local_results(loose) == (loose,)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    copies = strategy.experimental_local_results(model[0].weight)
    assert len(copies) == n
    assert copies[0] is model[0].weight
    for c in copies:
        assert torch.equal(c, model[0].weight)
    modules = strategy.experimental_local_results(model)
    assert len(modules) == n and modules[0] is model
    for m in modules:
        assert isinstance(m, nn.Sequential)
        for p, q in zip(m.parameters(), model.parameters(), strict=True):
            assert torch.equal(p, q)
        x = torch.randn(5, 3)
        assert torch.equal(m(x), model(x))


def test_random_init_copies_identical(multi):
    n = multi.num_replicas_in_sync
    torch.manual_seed(1234)
    with multi.scope():
        model = nn.Linear(8, 8)
    assert model.weight.abs().sum() > 0  # really random

    def fn():
        return model.weight * 1.0, model.bias * 1.0

    weights, biases = multi.run(fn)
    for w, b in zip(local(multi, weights), local(multi, biases), strict=True):
        assert torch.equal(w, model.weight.detach())
        assert torch.equal(b, model.bias.detach())
    assert len(local(multi, weights)) == n


def test_each_replica_uses_its_own_copy(multi):
    n = multi.num_replicas_in_sync
    with multi.scope():
        layer = nn.Linear(2, 1, bias=False)
    multi.run(lambda: None)  # first run: the fresh copies are made equal to copy 0
    copies = multi.experimental_local_results(layer.weight)
    assert len({c.data_ptr() for c in copies}) == n
    # extended.update gives every copy its own component of a PerReplica argument
    values = td.PerReplica([torch.full((1, 2), float(k)) for k in range(n)])
    multi.extended.update(layer.weight, lambda var, v: var.copy_(v), args=(values,))
    out = multi.run(lambda: layer(torch.ones(1, 2)).detach())
    assert [float(v) for v in local(multi, out)] == [2.0 * k for k in range(n)]
    # a plain update reaches every copy
    multi.extended.update(layer.weight, lambda var, v: var.fill_(v), args=(3.0,))
    out = multi.run(lambda: layer(torch.ones(1, 2)).detach())
    assert [float(v) for v in local(multi, out)] == [6.0] * n


def test_exception_in_one_replica_others_return(multi):
    def fn():
        if replica_id() == 0:
            raise Boom("first")
        return 1

    with pytest.raises(Boom, match="first"):
        multi.run(fn)
    assert local(multi, multi.run(lambda: 2)) == (2,) * multi.num_replicas_in_sync


def test_reduce_python_numbers(strategy):
    n = strategy.num_replicas_in_sync
    out = strategy.run(lambda: float(replica_id()) + 0.5)
    assert float(strategy.reduce("sum", out, axis=None)) == sum(range(n)) + 0.5 * n
    assert float(strategy.reduce("mean", out, axis=None)) == (sum(range(n)) + 0.5 * n) / n


def test_module_dtype_change_after_creation(strategy):
    with strategy.scope():
        model = nn.Linear(3, 2)
    strategy.run(lambda: model(torch.ones(1, 3)))
    model.double()
    x = torch.ones(1, 3, dtype=torch.float64)
    out = strategy.run(lambda: model(x).detach())
    for v in local(strategy, out):
        assert v.dtype == torch.float64
        assert torch.equal(v, model(x).detach())


def test_shared_parameter_module(strategy):
    with strategy.scope():
        shared = nn.Linear(2, 2, bias=False)
        model = nn.Sequential(shared, nn.Tanh(), shared)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        strategy.run(step, args=(distribute_one_batch(strategy, torch.randn(5, 2)),))
    assert copies_equal(strategy, model)
    modules = local(strategy, model)
    for m in modules:
        assert m[0].weight is m[2].weight


def test_run_args_must_be_tuple(strategy):
    x = torch.ones(2)
    for bad in (x, "ab", 3, {"a": x}):
        with pytest.raises(td.InvalidArgumentError, match="tuple"):
            strategy.run(lambda v: v, args=bad)
    with pytest.raises(td.InvalidArgumentError):
        strategy.run(lambda v: v, args=(x,), kwargs=[1])
    out = strategy.run(lambda v: v * 2, args=(x,))
    for v in local(strategy, out):
        assert torch.equal(v, x * 2)


# -- training: mirrored state ------------------------------------------------------------------


def copies_equal(strategy, module):
    modules = strategy.experimental_local_results(module)
    state0 = modules[0].state_dict()
    for other in modules[1:]:
        for key, value in other.state_dict().items():
            if not torch.equal(value, state0[key]):
                return False
    return True


@pytest.mark.parametrize("optim", ["sgd_momentum", "adam", "adamw"])
def test_copies_bitwise_equal_after_every_step(strategy, optim):
    n = strategy.num_replicas_in_sync
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        if optim == "sgd_momentum":
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        elif optim == "adam":
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    before = [p.detach().clone() for p in model.parameters()]

    def step(x):
        loss = model(x).pow(2).sum() / 6
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for i in range(4):
        x = torch.randn(6, 4) + i
        strategy.run(step, args=(distribute_one_batch(strategy, x),))
        assert copies_equal(strategy, model)
    assert not all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for m in local(strategy, model) for p in m.parameters())
    assert len(local(strategy, model)) == n


def test_optimizer_step_sums_gradients_exactly(strategy):
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        layer = nn.Linear(1, 1, bias=False)
        opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    with torch.no_grad():
        layer.weight.fill_(1.0)

    def step():
        r = replica_id()
        # d/dw of (w * (r+1)) is r+1
        (layer(torch.tensor([[float(r + 1)]])).sum()).backward()
        opt.step()
        opt.zero_grad()

    strategy.run(step)
    expected = 1.0 - 0.5 * sum(r + 1 for r in range(n))
    for c in strategy.experimental_local_results(layer.weight):
        assert c.item() == expected


def test_optimizer_step_and_zero_grad_in_cross_replica_context(strategy):
    """backward inside run, then optimizer.step()/zero_grad() in the user's loop."""
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        layer = nn.Linear(1, 1, bias=False)
        opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    with torch.no_grad():
        layer.weight.fill_(1.0)

    def backward():
        layer(torch.tensor([[float(replica_id() + 1)]])).sum().backward()

    strategy.run(backward)
    opt.step()
    opt.zero_grad()
    expected = 1.0 - 0.5 * sum(r + 1 for r in range(n))
    for c in strategy.experimental_local_results(layer.weight):
        assert c.item() == expected
    # zero_grad outside run drops every replica's gradient
    strategy.run(backward)
    opt.zero_grad()
    assert all(c.grad is None for c in strategy.experimental_local_results(layer.weight))
    opt.step()
    for c in strategy.experimental_local_results(layer.weight):
        assert c.item() == expected




@pytest.mark.parametrize("n", [1, 2, 3])
def test_zero_grad_set_to_none_false_inside_run(n):
    strategy = make_strategy(n)
    with strategy.scope():
        layer = nn.Linear(2, 1)
        opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    with torch.no_grad():
        layer.weight.fill_(1.0)
        layer.bias.fill_(0.0)

    def step():
        opt.zero_grad(set_to_none=False)
        layer(torch.ones(1, 2)).sum().backward()
        opt.step()

    for _ in range(3):
        strategy.run(step)
    # every step: each replica's grad is ones, summed over n replicas
    for c in strategy.experimental_local_results(layer.weight):
        torch.testing.assert_close(c, torch.full((1, 2), 1.0 - 3 * 0.5 * n))


def test_all_reduce_shape_mismatch_no_hang(multi):
    def fn():
        return td.get_replica_context().all_reduce("sum", torch.ones(replica_id() + 1))

    with pytest.raises(td.InvalidArgumentError, match="shape"):
        multi.run(fn)

    def fn2():
        return td.get_replica_context().all_reduce("sum", [torch.ones(1)] * (replica_id() + 1))

    with pytest.raises(td.ReplicaMismatchError):
        multi.run(fn2)
    assert local(multi, multi.run(lambda: 3)) == (3,) * multi.num_replicas_in_sync


def test_lr_scheduler_steps_once_per_step(strategy):
    with strategy.scope():
        layer = nn.Linear(2, 1)
        opt = torch.optim.SGD(layer.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step():
        layer(torch.ones(1, 2)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()

    for _ in range(3):
        strategy.run(step)
    assert sched.last_epoch == 3
    assert opt.param_groups[0]["lr"] == 0.125


def test_module_outside_scope(strategy):
    model = nn.Linear(3, 2)
    x = torch.ones(4, 3)
    if strategy.num_replicas_in_sync == 1:
        out = strategy.run(lambda: model(x))
        assert torch.equal(out, model(x))
        return
    with pytest.raises(td.UnmirroredStateError, match="scope"):
        strategy.run(lambda: model(x))
    # still usable afterwards
    assert set(local(strategy, strategy.run(lambda: 1))) == {1}


def test_optimizer_outside_scope(multi):
    with multi.scope():
        model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        model(torch.ones(2, 3)).sum().backward()
        opt.step()

    with pytest.raises(td.UnmirroredStateError, match="optimizer"):
        multi.run(step)


def test_optimizer_outside_scope_one_replica():
    strategy = make_strategy(1)
    with strategy.scope():
        model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()

    def step():
        model(torch.ones(2, 3)).sum().backward()
        opt.step()

    strategy.run(step)
    assert not torch.equal(before, model.weight)


@pytest.mark.parametrize("how", ["fill", "load_state_dict", "copy_in_scope"])
def test_cross_replica_changes_reach_replicas(strategy, how):
    with strategy.scope():
        model = nn.Linear(3, 2)
    strategy.run(lambda: model(torch.ones(1, 3)))  # copies exist now
    target = {"weight": torch.arange(6.0).reshape(2, 3), "bias": torch.tensor([-1.0, 1.0])}
    if how == "fill":
        with torch.no_grad():
            model.weight.fill_(1.0)
            model.bias.fill_(2.0)
        target = {"weight": torch.ones(2, 3), "bias": torch.full((2,), 2.0)}
    elif how == "load_state_dict":
        model.load_state_dict(target)
    else:
        with strategy.scope(), torch.no_grad():
            model.weight.copy_(target["weight"])
            model.bias.copy_(target["bias"])

    out = strategy.run(lambda: model(torch.ones(1, 3)).detach())
    expected = target["weight"].sum(1) + target["bias"]
    for v in local(strategy, out):
        assert torch.equal(v, expected.unsqueeze(0))
    for m in local(strategy, model):
        assert torch.equal(m.weight, target["weight"]) and torch.equal(m.bias, target["bias"])


class _Accumulator(nn.Module):
    """A float buffer and an integer buffer updated in place by ordinary tensor ops."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(2))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.total.add_(x.sum(0))
        self.steps.add_(1)
        return x


def test_float_buffers_are_replica_mean(strategy):
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        acc = _Accumulator()
    batches = [torch.tensor([[1.0, 2.0], [3.0, 4.0 * r]]) * (r + 1) for r in range(n)]
    strategy.run(lambda b: acc(b), args=(per_replica_of(strategy, batches),))
    expected = torch.stack([b.sum(0) for b in batches]).mean(0)
    torch.testing.assert_close(acc.total, expected)
    assert int(acc.steps) == 1
    for m in local(strategy, acc):
        assert torch.equal(m.total, acc.total) and int(m.steps) == 1




@pytest.mark.parametrize("n", [1, 2, 3])
def test_batchnorm_running_stats_are_replica_mean(n):
    strategy = make_strategy(n)
    with strategy.scope():
        bn = nn.BatchNorm1d(2, momentum=0.5)
    batches = [torch.tensor([[0.0, 1.0], [2.0, 3.0 + r]]) * (r + 1) for r in range(n)]
    dist = per_replica_of(strategy, batches)
    strategy.run(lambda b: bn(b), args=(dist,))
    expected_mean = torch.stack([0.5 * b.mean(0) for b in batches]).mean(0)
    expected_var = torch.stack([0.5 + 0.5 * b.var(0, unbiased=True) for b in batches]).mean(0)
    torch.testing.assert_close(bn.running_mean, expected_mean)
    torch.testing.assert_close(bn.running_var, expected_var)
    assert int(bn.num_batches_tracked) == 1
    for m in local(strategy, bn):
        assert torch.equal(m.running_mean, bn.running_mean)
        assert torch.equal(m.running_var, bn.running_var)
        assert int(m.num_batches_tracked) == 1
    # eval mode on every replica uses the merged statistics
    bn.eval()
    x = torch.ones(1, 2)
    out = strategy.run(lambda: bn(x).detach())
    for v in local(strategy, out):
        assert torch.equal(v, bn(x).detach())


def test_distribute_values_from_function(strategy):
    n = strategy.num_replicas_in_sync
    contexts = []

    def value_fn(ctx):
        contexts.append(ctx)
        return {"id": torch.tensor(ctx.replica_id_in_sync_group), "n": ctx.num_replicas_in_sync}

    value = strategy.experimental_distribute_values_from_function(value_fn)
    # Regrouped as TensorFlow's regroup does: a dict of PerReplica, not a PerReplica of dicts.
    assert isinstance(value, dict) and all(isinstance(v, td.PerReplica) for v in value.values())
    assert [c.replica_id_in_sync_group for c in contexts] == list(range(n))
    assert all(c.num_replicas_in_sync == n and isinstance(c, td.ValueContext) for c in contexts)
    out = strategy.run(lambda v: (v["id"] * 10, v["n"]), args=(value,))
    assert [int(v) for v in local(strategy, out[0])] == [10 * i for i in range(n)]
    assert set(local(strategy, out[1])) == {n}


def test_grad_mode_propagates(strategy):
    with strategy.scope():
        model = nn.Linear(2, 1)
    x = torch.ones(1, 2)
    with torch.no_grad():
        out = strategy.run(lambda: (model(x).requires_grad, torch.is_grad_enabled()))
    assert all(v is False for v in local(strategy, out[0]))
    assert all(v is False for v in local(strategy, out[1]))
    out = strategy.run(lambda: model(x).requires_grad)
    assert all(v is True for v in local(strategy, out))
    with torch.inference_mode():
        out = strategy.run(lambda: torch.is_inference_mode_enabled())
    assert all(v is True for v in local(strategy, out))


# -- OneDeviceStrategy -----------------------------------------------------------------------


def test_one_device_runs_in_calling_thread():
    strategy = td.OneDeviceStrategy("cpu")
    assert strategy.num_replicas_in_sync == 1
    out = strategy.run(lambda: (threading.get_ident(), replica_id(), td.get_strategy()))
    assert out[0] == threading.get_ident()
    assert out[1] == 0
    assert out[2] is strategy


def test_one_device_scope_places_params_on_cpu():
    strategy = td.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for t in list(model.parameters()) + list(model.buffers()):
        assert t.device == torch.device("cpu")
    assert strategy.experimental_local_results(model) == (model,)

    def step(x):
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    loss = strategy.run(step, args=(torch.randn(4, 2),))
    assert isinstance(loss, torch.Tensor)
    assert torch.equal(strategy.reduce("sum", loss, axis=None), loss.detach())


def test_one_device_errors():
    strategy = td.OneDeviceStrategy("cpu")
    with pytest.raises(td.InvalidArgumentError):
        strategy.run(lambda x: x, args=1)
    with pytest.raises(td.ContextError):
        strategy.run(lambda: strategy.reduce("sum", torch.ones(1), axis=None))
    with pytest.raises(td.InvalidDeviceError):
        td.OneDeviceStrategy("nonsense")
