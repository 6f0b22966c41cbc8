"""Distributed datasets: splitting global batches, epochs, bad input, datasets from functions."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torch_distribute as td
from torch_distribute.input import batch_sizes_for_worker

pytestmark = pytest.mark.timeout(60)


def make_strategy(n: int) -> td.MirroredStrategy:
    return td.MirroredStrategy([f"cpu:{i}" for i in range(n)])


@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"N{n}")
def strategy(request):
    return make_strategy(request.param)


def local(strategy, value):
    return strategy.experimental_local_results(value)


def sizes_of(strategy, value):
    return [v.shape[0] for v in local(strategy, value)]


def xy_batch(g: int, start: int = 0):
    x = torch.arange(start, start + g * 3, dtype=torch.float32).reshape(g, 3)
    y = torch.arange(start, start + g, dtype=torch.int64)
    return x, y


# -- sizes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "g", "expected"),
    # TensorFlow 2.21's split: ceil(rows / replicas) each, in order, the last ones smaller or empty.
    [(2, 7, [4, 3]), (4, 10, [3, 3, 3, 1]), (3, 10, [4, 4, 2]), (3, 5, [2, 2, 1]), (3, 4, [2, 2, 0]),
     (3, 1, [1, 0, 0]), (4, 2, [1, 1, 0, 0]), (2, 8, [4, 4]), (1, 7, [7]), (3, 0, [0, 0, 0])],
)
def test_per_replica_sizes(n, g, expected):
    strategy = make_strategy(n)
    x, y = xy_batch(g)
    (dx, dy), = list(strategy.experimental_distribute_dataset([(x, y)]))
    assert sizes_of(strategy, dx) == expected
    assert sizes_of(strategy, dy) == expected
    assert torch.equal(strategy.gather(dx, 0), x)
    assert torch.equal(strategy.gather(dy, 0), y)
    if n > 1:
        assert isinstance(dx, td.PerReplica) and isinstance(dy, td.PerReplica)


def test_empty_replicas_have_right_shape_and_dtype():
    strategy = make_strategy(4)
    x = torch.randn(2, 3, 5)
    y = torch.tensor([1, 2], dtype=torch.int64)
    mask = torch.tensor([True, False])
    batch = {"x": x, "y": y, "m": mask, "h": torch.ones(2, dtype=torch.float16)}
    (dist,) = list(strategy.experimental_distribute_dataset([batch]))
    assert set(dist) == {"x", "y", "m", "h"}
    xs, ys, ms, hs = (local(strategy, dist[k]) for k in ("x", "y", "m", "h"))
    for k in (2, 3):
        assert xs[k].shape == (0, 3, 5) and xs[k].dtype == torch.float32
        assert ys[k].shape == (0,) and ys[k].dtype == torch.int64
        assert ms[k].shape == (0,) and ms[k].dtype == torch.bool
        assert hs[k].shape == (0,) and hs[k].dtype == torch.float16
    assert torch.equal(xs[0], x[:1]) and torch.equal(xs[1], x[1:])


def test_empty_replicas_run_a_step():
    strategy = make_strategy(3)
    with strategy.scope():
        layer = torch.nn.Linear(3, 1)
    (x, y), = list(strategy.experimental_distribute_dataset([xy_batch(1)]))
    out = strategy.run(lambda a, b: (layer(a).squeeze(1) - b).pow(2), args=(x, y))
    assert sizes_of(strategy, out) == [1, 0, 0]
    total = strategy.reduce("sum", out, axis=0)
    torch.testing.assert_close(total, (layer(xy_batch(1)[0]).squeeze(1) - 0).pow(2).sum().detach())


# -- kinds of datasets -------------------------------------------------------------------------


def batches_xy():
    return [xy_batch(7, 0), xy_batch(7, 100), xy_batch(3, 200)]


def check_xy_epoch(strategy, dist, batches):
    steps = list(dist)
    assert len(steps) == len(batches)
    n = strategy.num_replicas_in_sync
    for (dx, dy), (x, y) in zip(steps, batches, strict=True):
        g = x.shape[0]
        chunk = -(-g // n)  # TensorFlow 2.21's split: ceil(rows / replicas), in order
        expected = [max(0, min(chunk, g - k * chunk)) for k in range(n)]
        assert sizes_of(strategy, dx) == expected
        assert torch.equal(strategy.gather(dx, 0), x)
        assert torch.equal(strategy.gather(dy, 0), y)


def test_list_of_tuples(strategy):
    batches = batches_xy()
    check_xy_epoch(strategy, strategy.experimental_distribute_dataset(batches), batches)


def test_list_of_dicts(strategy):
    batches = [{"image": x, "label": y} for x, y in batches_xy()]
    dist = strategy.experimental_distribute_dataset(batches)
    steps = list(dist)
    assert len(steps) == 3
    for step, batch in zip(steps, batches, strict=True):
        assert isinstance(step, dict) and set(step) == {"image", "label"}
        assert torch.equal(strategy.gather(step["image"], 0), batch["image"])
        assert torch.equal(strategy.gather(step["label"], 0), batch["label"])


def test_numpy_arrays(strategy):
    batches = [(x.numpy(), y.numpy()) for x, y in batches_xy()]
    dist = strategy.experimental_distribute_dataset(batches)
    for (dx, dy), (x, y) in zip(dist, batches, strict=True):
        for v in local(strategy, dx):
            assert isinstance(v, torch.Tensor) and v.dtype == torch.float32
        for v in local(strategy, dy):
            assert isinstance(v, torch.Tensor) and v.dtype == torch.int64
        assert torch.equal(strategy.gather(dx, 0), torch.from_numpy(x))
        assert torch.equal(strategy.gather(dy, 0), torch.from_numpy(y))


def test_plain_numpy_batches(strategy):
    batches = [np.arange(10.0).reshape(5, 2), np.arange(4.0).reshape(2, 2)]
    steps = list(strategy.experimental_distribute_dataset(batches))
    assert torch.equal(strategy.gather(steps[0], 0), torch.from_numpy(batches[0]))
    assert torch.equal(strategy.gather(steps[1], 0), torch.from_numpy(batches[1]))


def test_dataloader(strategy):
    x = torch.arange(30, dtype=torch.float32).reshape(10, 3)
    y = torch.arange(10)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)
    dist = strategy.experimental_distribute_dataset(loader)
    assert len(dist) == 3
    batches = [(x[:4], y[:4]), (x[4:8], y[4:8]), (x[8:], y[8:])]
    check_xy_epoch(strategy, dist, batches)
    # a new epoch: the same data again
    check_xy_epoch(strategy, dist, batches)


def test_dataloader_of_dicts():
    strategy = make_strategy(2)

    class DictDataset(torch.utils.data.Dataset):
        def __len__(self):
            return 5

        def __getitem__(self, i):
            return {"x": torch.tensor([float(i)]), "y": i}

    loader = DataLoader(DictDataset(), batch_size=5)
    (step,) = list(strategy.experimental_distribute_dataset(loader))
    assert sizes_of(strategy, step["x"]) == [3, 2]
    assert torch.equal(strategy.gather(step["y"], 0), torch.arange(5))


def test_generator(strategy):
    batches = batches_xy()
    dist = strategy.experimental_distribute_dataset(b for b in batches)
    check_xy_epoch(strategy, dist, batches)
    with pytest.raises(td.DatasetError, match="generator"):
        list(dist)


def test_infinite_generator_is_lazy(strategy):
    def forever():
        for i in itertools.count():
            yield torch.full((4,), float(i))

    it = iter(strategy.experimental_distribute_dataset(forever()))
    for i in range(3):
        assert torch.equal(strategy.gather(next(it), 0), torch.full((4,), float(i)))
    assert torch.equal(strategy.gather(it.get_next(), 0), torch.full((4,), 3.0))


def test_reiterating_starts_new_epoch(strategy):
    batches = batches_xy()
    dist = strategy.experimental_distribute_dataset(batches)
    first = [strategy.gather(x, 0) for x, _ in dist]
    it = iter(dist)
    next(it)
    # a fresh iterator starts from the beginning, independent of a partly used one
    second = [strategy.gather(x, 0) for x, _ in dist]
    assert len(first) == len(second) == 3
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(strategy.gather(next(it)[0], 0), batches[1][0])


def test_stop_iteration_after_last(strategy):
    it = iter(strategy.experimental_distribute_dataset([xy_batch(2)]))
    next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_run_on_distributed_batches(strategy):
    batches = batches_xy()
    dist = strategy.experimental_distribute_dataset(batches)
    for (x, y), (gx, gy) in zip(dist, batches, strict=True):
        out = strategy.run(lambda a, b: (a.sum(1), b * 2, torch.tensor(a.shape[0])), args=(x, y))
        assert torch.equal(strategy.gather(out[0], 0), gx.sum(1))
        assert torch.equal(strategy.gather(out[1], 0), gy * 2)
        assert int(strategy.reduce("sum", out[2], axis=None)) == gx.shape[0]


def test_next_inside_replica_function(strategy):
    it = iter(strategy.experimental_distribute_dataset(batches_xy()))
    with pytest.raises(td.ContextError, match="outside strategy.run"):
        strategy.run(lambda: next(it))
    # the iterator was not advanced by the failed call
    x, _ = next(it)
    assert torch.equal(strategy.gather(x, 0), batches_xy()[0][0])


# -- bad input ------------------------------------------------------------------------------


def test_unbatched_list_of_scalars(strategy):
    dist = strategy.experimental_distribute_dataset([torch.tensor(1.0), torch.tensor(2.0)])
    with pytest.raises(td.DatasetError, match="unbatched") as info:
        list(dist)
    assert "DataLoader" in str(info.value)


def test_unbatched_tuples_of_scalars(strategy):
    dist = strategy.experimental_distribute_dataset([(torch.ones(3), torch.tensor(1))])
    with pytest.raises(td.DatasetError):
        list(dist)


def test_tensor_dataset_directly(strategy):
    ds = TensorDataset(torch.randn(10, 3), torch.arange(10))
    with pytest.raises(td.DatasetError):
        strategy.experimental_distribute_dataset(ds)


def test_tensor_dataset_directly_message_says_dataloader():
    strategy = make_strategy(2)
    ds = TensorDataset(torch.randn(10, 3), torch.arange(10))
    with pytest.raises(td.DatasetError, match="DataLoader"):
        strategy.experimental_distribute_dataset(ds)


def test_map_style_dataset_with_iter():
    """A map-style dataset that also defines __iter__ gets the DataLoader hint."""

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return torch.tensor(float(i))

        def __iter__(self):
            return (self[i] for i in range(len(self)))

    with pytest.raises(td.DatasetError, match="DataLoader"):
        make_strategy(2).experimental_distribute_dataset(Rows())


def test_empty_list(strategy):
    with pytest.raises(td.DatasetError, match="no batches"):
        list(strategy.experimental_distribute_dataset([]))


def test_empty_dataloader(strategy):
    loader = DataLoader(TensorDataset(torch.zeros(0, 2)), batch_size=4)
    with pytest.raises(td.DatasetError):
        list(strategy.experimental_distribute_dataset(loader))


def test_not_iterable(strategy):
    with pytest.raises(td.DatasetError):
        strategy.experimental_distribute_dataset(42)


def test_mismatched_first_dims(strategy):
    dist = strategy.experimental_distribute_dataset([(torch.ones(4, 2), torch.ones(3))])
    with pytest.raises(td.DatasetError, match="first dimension"):
        list(dist)
    dist = strategy.experimental_distribute_dataset([{"a": torch.ones(4), "b": torch.ones(5, 1)}])
    with pytest.raises(td.DatasetError):
        list(dist)


@pytest.mark.parametrize("element", [("a string", torch.ones(2)), [1, 2, 3], (torch.ones(2), None)])
def test_non_tensor_elements(strategy, element):
    with pytest.raises(td.DatasetError):
        list(strategy.experimental_distribute_dataset([element]))


def test_dataset_error_is_value_error():
    assert issubclass(td.DatasetError, ValueError)


# -- datasets from a function --------------------------------------------------------------


@pytest.mark.parametrize("num_elements", [6, 7, 1])
def test_distribute_datasets_from_function(strategy, num_elements):
    n = strategy.num_replicas_in_sync
    contexts = []
    elements = [(torch.full((2, 3), float(i)), torch.full((2,), i)) for i in range(num_elements)]

    def dataset_fn(ctx):
        contexts.append(ctx)
        return elements

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    assert len(contexts) == 1
    ctx = contexts[0]
    assert isinstance(ctx, td.InputContext)
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, n)
    assert len(dist) == -(-num_elements // n)
    for epoch in range(2):
        steps = list(dist)
        assert len(steps) == -(-num_elements // n), epoch
        for s, (x, y) in enumerate(steps):
            xs, ys = local(strategy, x), local(strategy, y)
            assert len(xs) == n
            for k in range(n):
                i = s * n + k
                if i < num_elements:
                    assert torch.equal(xs[k], elements[i][0])
                    assert torch.equal(ys[k], elements[i][1])
                else:
                    assert xs[k].shape == (0, 3) and xs[k].dtype == torch.float32
                    assert ys[k].shape == (0,) and ys[k].dtype == torch.int64


def test_datasets_from_function_uses_input_context(strategy):
    n = strategy.num_replicas_in_sync

    def dataset_fn(ctx):
        b = ctx.get_per_replica_batch_size(6 * n)
        return DataLoader(TensorDataset(torch.arange(24.0)), batch_size=b)

    steps = list(strategy.distribute_datasets_from_function(dataset_fn))
    first = steps[0][0] if isinstance(steps[0], (list, tuple)) else steps[0]
    assert sizes_of(strategy, first) == [6] * n


def test_datasets_from_function_empty(strategy):
    with pytest.raises(td.DatasetError):
        list(strategy.distribute_datasets_from_function(lambda ctx: []))


def test_datasets_from_function_next_in_replica(strategy):
    it = iter(strategy.distribute_datasets_from_function(lambda ctx: [torch.ones(2)] * 4))
    with pytest.raises(td.ContextError):
        strategy.run(lambda: next(it))


# -- InputContext and batch sizes -----------------------------------------------------------------


def test_input_context_batch_size():
    ctx = td.InputContext(1, 0, 2)
    assert ctx.get_per_replica_batch_size(64) == 32
    assert ctx.get_per_replica_batch_size(0) == 0
    with pytest.raises(td.InvalidArgumentError, match="not divisible"):
        ctx.get_per_replica_batch_size(7)
    with pytest.raises(td.InvalidArgumentError):
        ctx.get_per_replica_batch_size(-2)
    with pytest.raises(td.InvalidArgumentError):
        ctx.get_per_replica_batch_size(8.0)
    assert td.InputContext(2, 1, 4).get_per_replica_batch_size(64) == 16
    default = td.InputContext()
    assert (default.num_input_pipelines, default.input_pipeline_id,
            default.num_replicas_in_sync) == (1, 0, 1)


@pytest.mark.parametrize("args", [(0, 0, 1), (1, 1, 1), (1, 0, 0), (2, -1, 2), (1.0, 0, 1)])
def test_input_context_bad_args(args):
    with pytest.raises(td.InvalidArgumentError):
        td.InputContext(*args)


def test_batch_sizes_for_worker():
    assert not hasattr(td, "batch_sizes_for_worker")
    assert batch_sizes_for_worker(10, 1, 4, 0) == [3, 3, 2, 2]
    assert batch_sizes_for_worker(7, 1, 2, 0) == [4, 3]
    assert batch_sizes_for_worker(1, 1, 3, 0) == [1, 0, 0]
    assert batch_sizes_for_worker(0, 1, 2, 0) == [0, 0]


def test_batch_sizes_for_worker_multi_worker():
    assert batch_sizes_for_worker(7, 2, 2, 0) == [2, 2, 2, 1]
    assert batch_sizes_for_worker(7, 2, 2, 1) == [2, 1, 2, 2]


@pytest.mark.parametrize("g", range(0, 23))
@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 5])
def test_batch_sizes_properties(g, replicas):
    sizes = batch_sizes_for_worker(g, 1, replicas, 0)
    assert len(sizes) == replicas
    assert sum(sizes) == g
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
