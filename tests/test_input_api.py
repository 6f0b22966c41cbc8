"""The input API's second half: get_next_as_optional, element_spec, every InputOptions field
(PER_REPLICA, place_dataset_on_device, fetch_to_device, per_replica_buffer_size) and a
dataset's own options (td.data.with_options) in experimental_distribute_dataset and fit."""

from __future__ import annotations

import io
import itertools
import os
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torch_distribute as td
from torch_distribute.cluster.launcher import launch
from torch_distribute.input import DatasetFromFunction, DistributedDataset
from torch_distribute.input.step_agreement import StepReport

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "multiworker"))
import input_api_job as J  # noqa: E402
import mw_helpers as H  # noqa: E402

pytestmark = pytest.mark.timeout(60)

CPU2 = [torch.device("cpu")] * 2
PER_REPLICA = td.InputReplicationMode.PER_REPLICA


def mirrored(n: int) -> td.MirroredStrategy:
    return td.MirroredStrategy([f"cpu:{i}" for i in range(n)])


def batches(count: int, rows: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) + 100 * i,
             torch.arange(rows) + 100 * i) for i in range(count)]


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class Counting:
    """An iterable of batches that counts how many have been taken from it."""

    def __init__(self, items: list):
        self.items = items
        self.taken = 0

    def __iter__(self):
        for item in self.items:
            self.taken += 1
            yield item


class Recorder:
    """Stands in for ``extended.gather_input_reports``: records whether this worker had data
    and replies with its report and another worker's, which has data as scripted."""

    def __init__(self, other_has_data: list[bool]):
        self.asked: list[bool] = []
        self._other = iter(other_has_data)

    def __call__(self, report: StepReport) -> list[StepReport]:
        self.asked.append(report.has_data)
        return [report, StepReport(next(self._other), 0, 0)]


def with_policy(dataset, policy):
    options = td.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    return td.data.with_options(dataset, options)


# -- get_next_as_optional ------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2])
def test_get_next_as_optional_gives_every_step_then_empty(n):
    strategy = mirrored(n)
    data = batches(3)
    expected = list(strategy.experimental_distribute_dataset(data))
    iterator = iter(strategy.experimental_distribute_dataset(data))
    got = []
    while (optional := iterator.get_next_as_optional()).has_value():
        got.append(optional.get_value())
    assert len(got) == 3
    for a, b in zip(got, expected, strict=True):
        for part_a, part_b in zip(a, b, strict=True):
            assert same(strategy.experimental_local_results(part_a), strategy.experimental_local_results(part_b))
    assert not iterator.get_next_as_optional().has_value()  # and stays at the end
    with pytest.raises(td.InvalidArgumentError, match="has_value"):
        optional.get_value()
    with pytest.raises(StopIteration):
        next(iterator)


def test_get_next_as_optional_on_a_dataset_from_function():
    strategy = mirrored(2)
    dist = strategy.distribute_datasets_from_function(lambda ctx: [torch.ones(2, 1) * i for i in range(3)])
    iterator = iter(dist)
    first, second, third = (iterator.get_next_as_optional() for _ in range(3))
    assert [first.has_value(), second.has_value(), third.has_value()] == [True, True, False]
    assert [t.shape[0] for t in second.get_value().values] == [2, 0]  # the last element, then an empty batch


def test_get_next_as_optional_waits_for_other_workers_without_another_collective():
    # This worker has 2 batches; another worker has 3: the third step is empty here, the
    # fourth is the end on every worker. One agreement per call, as next() makes.
    sync = Recorder([True, True, True, False])
    dataset = DistributedDataset(batches(2, rows=4), CPU2, num_workers=2, worker_index=0, sync_step=sync)
    iterator = iter(dataset)
    optionals = [iterator.get_next_as_optional() for _ in range(4)]
    assert [o.has_value() for o in optionals] == [True, True, True, False]
    assert sync.asked == [True, True, False, False]
    assert [t.shape for t in optionals[2].get_value()[0].values] == [(0, 2), (0, 2)]


def test_get_next_as_optional_is_refused_inside_a_replica_function():
    strategy = mirrored(2)
    iterator = iter(strategy.experimental_distribute_dataset(batches(1)))
    with pytest.raises(td.ContextError, match="outside strategy.run"):
        strategy.run(lambda: iterator.get_next_as_optional())


# -- element_spec --------------------------------------------------------------------------


def test_element_spec_of_datasets_and_iterators():
    strategy = mirrored(2)
    dist = strategy.experimental_distribute_dataset(batches(2))
    want = (td.TensorSpec((None, 2), torch.float32), td.TensorSpec((None,), torch.int64))
    assert dist.element_spec == want
    iterator = iter(dist)
    assert iterator.element_spec == want
    first = next(iterator)
    assert all(spec.is_compatible_with(part) for spec, t in zip(want, first, strict=True)
               for part in strategy.experimental_local_results(t))
    from_fn = strategy.distribute_datasets_from_function(lambda ctx: [{"x": torch.zeros(3, 5, dtype=torch.float16)}])
    assert from_fn.element_spec == {"x": td.TensorSpec((None, 5), torch.float16)}
    assert iter(from_fn).element_spec == from_fn.element_spec


def test_element_spec_loses_no_batch_and_draws_no_shuffle_order():
    strategy = mirrored(2)
    one_shot = strategy.experimental_distribute_dataset(iter(batches(3)))
    assert one_shot.element_spec[0].shape == (None, 2)
    assert len(list(one_shot)) == 3  # the batch read for the spec is still the first one

    def loader():
        return DataLoader(TensorDataset(torch.arange(20.0).reshape(10, 2)), batch_size=4, shuffle=True,
                          generator=torch.Generator().manual_seed(3))

    peeked = strategy.experimental_distribute_dataset(loader())
    assert peeked.element_spec == [td.TensorSpec((None, 2), torch.float32)]
    plain = strategy.experimental_distribute_dataset(loader())
    for _ in range(2):  # two epochs: the same shuffle orders with and without the peek
        for a, b in itertools.zip_longest(peeked, plain):
            assert same(a[0].values, b[0].values)


def test_element_spec_of_an_empty_dataset_is_an_error():
    with pytest.raises(td.DatasetError, match="empty"):
        mirrored(2).experimental_distribute_dataset([]).element_spec  # noqa: B018


# -- InputOptions --------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "message"), [
    ({"experimental_place_dataset_on_device": True}, "needs experimental_replication_mode"),
    ({"experimental_place_dataset_on_device": True, "experimental_replication_mode": PER_REPLICA},
     "experimental_fetch_to_device=False"),
    ({"experimental_per_replica_buffer_size": -1}, "non-negative"),
    ({"experimental_per_replica_buffer_size": 1.5}, "non-negative"),
    ({"experimental_replication_mode": "PER_REPLICA"}, "InputReplicationMode"),
    ({"auto_shard_policy": "OFF"}, "AutoShardPolicy"),
    ({"experimental_fetch_to_device": 1}, "True or False"),
])
def test_inconsistent_input_options_are_refused(options, message):
    with pytest.raises(td.InvalidArgumentError, match=message):
        td.InputOptions(**options)


def test_per_replica_mode_is_refused_by_experimental_distribute_dataset():
    with pytest.raises(td.InvalidArgumentError, match="distribute_datasets_from_function"):
        mirrored(2).experimental_distribute_dataset(
            batches(1), options=td.InputOptions(experimental_replication_mode=PER_REPLICA))


def per_replica_fn(contexts):
    def dataset_fn(ctx):
        contexts.append(ctx)
        rows = ctx.get_per_replica_batch_size(8)
        data = torch.arange(8 * 3, dtype=torch.float32).reshape(3, 8)  # 3 global batches of 8
        start = ctx.input_pipeline_id * rows
        return [data[i, start:start + rows].reshape(rows, 1) for i in range(3 - ctx.input_pipeline_id)]
    return dataset_fn


def test_per_replica_mode_calls_the_function_once_per_replica():
    contexts = []
    options = td.InputOptions(experimental_replication_mode=PER_REPLICA)
    dist = DatasetFromFunction.from_function(per_replica_fn(contexts), CPU2, num_workers=2, worker_index=1,
                                             replica_id_offset=2, num_replicas_in_sync=4, options=options)
    assert [(c.num_input_pipelines, c.input_pipeline_id, c.num_replicas_in_sync) for c in contexts] == [
        (4, 2, 4), (4, 3, 4)]
    assert len(dist) == 1
    steps = list(dist)
    assert len(steps) == 1
    # Replica 2 reads rows 4-5 of the first global batch; replica 3's dataset (3 - 3 batches) is
    # empty, so it gets an empty batch.
    assert [t.reshape(-1).tolist() for t in steps[0].values] == [[4.0, 5.0], []]


def test_per_replica_datasets_together_give_the_global_batches():
    options = td.InputOptions(experimental_replication_mode=PER_REPLICA)
    contexts = []
    dist = DatasetFromFunction.from_function(per_replica_fn(contexts), [torch.device("cpu")] * 4, options=options)
    steps = list(dist)
    # Replica r has 3 - r batches: every step runs while any has one, the others get empty batches.
    assert [[t.shape[0] for t in step.values] for step in steps] == [[2, 2, 2, 0], [2, 2, 0, 0], [2, 0, 0, 0]]
    data = torch.arange(24, dtype=torch.float32).reshape(3, 8)
    for i, step in enumerate(steps):
        got = torch.cat(list(step.values)).reshape(-1)
        assert torch.equal(got, data[i, :got.numel()])


@pytest.mark.parametrize("mode", ["PER_WORKER", "PER_REPLICA"])
def test_a_dataset_function_batched_per_replica_trains_as_one_device(mode):
    # One process of 4 (PER_REPLICA) or 2 (PER_WORKER) CPU replicas, each batch of
    # ctx.get_per_replica_batch_size(8) rows, compute_average_loss(global_batch_size=8): the
    # parameters of one device trained on the global batches of 8 (22 examples: 8, 8, 6).
    generator = torch.Generator().manual_seed(11)
    x, y = torch.randn(22, 3, generator=generator), torch.randn(22, 1, generator=generator)
    replicas = 4 if mode == "PER_REPLICA" else 2

    def dataset_fn(ctx):
        rows = ctx.get_per_replica_batch_size(8)
        if mode == "PER_WORKER":  # one pipeline: its replicas take consecutive batches
            return DataLoader(TensorDataset(x, y), batch_size=rows)
        mine = [i for start in range(0, 22, 8) for i in range(start + ctx.input_pipeline_id * rows,
                                                                min(start + (ctx.input_pipeline_id + 1) * rows, 22))]
        return DataLoader(TensorDataset(x[mine], y[mine]), batch_size=rows)

    def train(strategy, dataset):
        torch.manual_seed(0)
        with strategy.scope():
            model = torch.nn.Linear(3, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(xb, yb):
            td.compute_average_loss((model(xb) - yb).pow(2).squeeze(1), global_batch_size=8).backward()
            optimizer.step()
            optimizer.zero_grad()
            return torch.tensor(xb.shape[0])

        rows = [int(strategy.reduce("sum", strategy.run(step, args=batch), axis=None)) for batch in dataset]
        return rows, torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    strategy = mirrored(replicas)
    options = td.InputOptions(experimental_replication_mode=td.InputReplicationMode[mode])
    rows, params = train(strategy, strategy.distribute_datasets_from_function(dataset_fn, options))
    one_device = td.OneDeviceStrategy("cpu")
    reference_rows, reference = train(one_device, DataLoader(TensorDataset(x, y), batch_size=8))
    assert rows == reference_rows == [8, 8, 6]
    torch.testing.assert_close(params, reference, rtol=1e-6, atol=1e-7)


def test_per_replica_needs_the_dataset_function():
    options = td.InputOptions(experimental_replication_mode=PER_REPLICA)
    with pytest.raises(td.InvalidArgumentError, match="from_function"):
        DatasetFromFunction(batches(2), CPU2, options=options)
    with pytest.raises(td.InvalidArgumentError, match="one per replica"):
        DatasetFromFunction(None, CPU2, options=options, replica_datasets=[batches(1)])


def test_place_dataset_on_device_makes_the_pipeline_on_the_replica_device():
    # The meta device stands in for an accelerator: what the pipeline makes lands there.
    made_in_fn = []

    def dataset_fn(ctx):
        made_in_fn.append(torch.zeros(1).device)

        def generate():
            for _ in range(2):
                yield torch.ones(3, 2)  # made lazily, at each next()
        return generate()

    options = td.InputOptions(experimental_replication_mode=PER_REPLICA, experimental_place_dataset_on_device=True,
                              experimental_fetch_to_device=False)
    meta = [torch.device("meta")] * 2
    dist = DatasetFromFunction.from_function(dataset_fn, meta, options=options)
    assert made_in_fn == meta
    steps = list(dist)
    assert len(steps) == 2 and all(t.device.type == "meta" for step in steps for t in step.values)
    assert torch.zeros(1).device.type == "cpu"  # the default device is given back


def test_fetch_to_device_false_leaves_batches_where_they_are():
    strategy = mirrored(2)
    on_meta = [torch.empty(4, 3, device="meta")]
    kept = next(iter(strategy.experimental_distribute_dataset(
        on_meta, options=td.InputOptions(experimental_fetch_to_device=False))))
    assert [t.device.type for t in kept.values] == ["meta", "meta"]  # no copy was attempted
    with pytest.raises(NotImplementedError):  # fetching does copy (and a meta tensor cannot be)
        next(iter(strategy.experimental_distribute_dataset(on_meta)))


@pytest.mark.parametrize("size", [0, 1, 3])
def test_per_replica_buffer_size_is_how_far_ahead_the_source_is_read(size):
    strategy = mirrored(2)
    source = Counting(batches(6))
    options = td.InputOptions(experimental_per_replica_buffer_size=size)
    dist = strategy.experimental_distribute_dataset(source, options=options)
    iterator = iter(dist)
    assert source.taken == 0
    got = []
    for step in range(6):
        got.append(next(iterator))
        assert source.taken == min(6, step + 1 + size)
    reference = list(strategy.experimental_distribute_dataset(batches(6)))
    for a, b in zip(got, reference, strict=True):
        assert same(a[0].values, b[0].values) and same(a[1].values, b[1].values)


def test_per_replica_buffer_size_in_a_dataset_from_function():
    source = Counting([torch.ones(1, 1) * i for i in range(9)])
    dist = DatasetFromFunction(source, CPU2, options=td.InputOptions(experimental_per_replica_buffer_size=2))
    iterator = iter(dist)
    next(iterator)
    assert source.taken == 2 * 3  # two replicas' elements for this step and the 2 steps ahead
    assert [t.item() for t in next(iterator).values] == [2.0, 3.0]


def test_the_default_buffer_prefetches_only_where_there_is_a_copy_to_overlap():
    assert td.InputOptions().experimental_per_replica_buffer_size is None
    assert mirrored(2).experimental_distribute_dataset(batches(1)).buffer_size == 0  # CPU replicas
    on_gpu = DistributedDataset(batches(1), [torch.device("cuda", 0)])
    assert on_gpu.buffer_size == 1
    host_only = DistributedDataset(batches(1), [torch.device("cuda", 0)],
                                   options=td.InputOptions(experimental_fetch_to_device=False))
    assert host_only.buffer_size == 0


def test_the_buffer_reads_ahead_only_locally_one_agreement_per_step():
    sync = Recorder([True, True, True, False])
    source = Counting(batches(3, rows=4))
    dataset = DistributedDataset(source, CPU2, num_workers=2, worker_index=1, sync_step=sync,
                                 options=td.InputOptions(experimental_per_replica_buffer_size=2))
    assert len(list(dataset)) == 3
    assert sync.asked == [True, True, True, False]


# -- a dataset's own options ---------------------------------------------------------------


class Shardable(list):
    def shard(self, num_shards: int, index: int) -> Shardable:
        return Shardable(self[index::num_shards])


def rows_of(dist) -> list[list[int]]:
    return [[int(t.shape[0]) for t in step[0].values] for step in dist]


def test_the_dataset_policy_is_honoured_and_the_call_policy_wins():
    data = Shardable(batches(4, rows=8))
    make = lambda ds, options=None: DistributedDataset(ds, CPU2, num_workers=2, worker_index=1,  # noqa: E731
                                                       options=options)
    assert make(data).shard_policy is td.AutoShardPolicy.FILE  # AUTO: it can shard itself
    # Every batch holds a global batch of 8 rows, 2 per replica of the 2 x 2. FILE: worker 1 reads
    # batches 1 and 3, 2 steps each; OFF: all 4 batches, 2 steps each; DATA: its half of each.
    assert rows_of(make(data)) == [[2, 2]] * 4
    for policy, steps in ((td.AutoShardPolicy.OFF, [[2, 2]] * 8), (td.AutoShardPolicy.DATA, [[2, 2]] * 4)):
        own = make(with_policy(data, policy))
        assert own.shard_policy is policy and rows_of(own) == steps
    overridden = make(with_policy(data, td.AutoShardPolicy.OFF), td.InputOptions(auto_shard_policy=td.AutoShardPolicy.DATA))
    assert overridden.shard_policy is td.AutoShardPolicy.DATA
    with pytest.raises(td.DatasetError, match="shard"):
        make(with_policy(list(data), td.AutoShardPolicy.FILE))


def test_with_options_keeps_the_dataset_and_merges_options():
    loader = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=4)
    wrapped = with_policy(loader, td.data.AutoShardPolicy.OFF)
    assert len(wrapped) == 3 and wrapped.batch_size == 4
    assert all(same(a, b) for a, b in zip(wrapped, loader, strict=True))
    merged = td.data.with_options(wrapped, td.data.Options())  # nothing set: the policy stays
    assert merged.options().experimental_distribute.auto_shard_policy is td.data.AutoShardPolicy.OFF
    assert with_policy(merged, td.data.AutoShardPolicy.DATA).options().experimental_distribute.auto_shard_policy \
        is td.data.AutoShardPolicy.DATA
    one_shot = td.data.with_options(iter(batches(2)), td.data.Options())
    assert iter(one_shot) is one_shot and len(list(one_shot)) == 2 and list(one_shot) == []
    with pytest.raises(td.InvalidArgumentError, match="Options"):
        td.data.with_options(loader, {"auto_shard_policy": "OFF"})
    bad = td.data.Options()
    bad.experimental_distribute.auto_shard_policy = "OFF"
    with pytest.raises(td.InvalidArgumentError, match="AutoShardPolicy"):
        td.data.with_options(loader, bad)


def test_fit_on_a_dataset_with_options_in_one_process():
    x = torch.randn(12, 3, generator=torch.Generator().manual_seed(0))
    data = [(x[i:i + 4], x[i:i + 4].sum(1, keepdim=True)) for i in range(0, 12, 4)]
    params = []
    for dataset in (data, with_policy(data, td.data.AutoShardPolicy.OFF)):
        strategy = mirrored(2)
        torch.manual_seed(0)
        with strategy.scope():
            model = td.keras.Model(torch.nn.Linear(3, 1))
        model.compile(td.keras.optimizers.SGD(learning_rate=0.1), td.keras.losses.MeanSquaredError())
        model.fit(dataset, epochs=2, verbose=0)
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert torch.equal(params[0], params[1])  # one worker: every policy reads the same batches


# -- two worker processes ------------------------------------------------------------------


def _reference_fit() -> list[float]:
    """One process, no strategy: step k trains on both workers' k-th pieces of 4 rows together
    (each worker's batch of 8 rows makes two steps under AutoShardPolicy.OFF)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for (x0, y0), (x1, y1) in zip(J.share(0, 2), J.share(1, 2), strict=True):
        for half in (slice(0, 4), slice(4, 8)):
            x, y = torch.cat([x0[half], x1[half]]), torch.cat([y0[half], y1[half]]).unsqueeze(1)
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    return [float(v) for p in model.parameters() for v in p.detach().reshape(-1)]


@pytest.mark.timeout(120)
@pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")
def test_two_workers_optional_end_of_data_and_fit_with_the_dataset_policy():
    out, err = io.StringIO(), io.StringIO()
    code = launch([str(HERE / "multiworker" / "input_api_job.py")], 2, env_mode="torchrun", grace_period=2,
                  timeout=90, extra_env={"OMP_NUM_THREADS": "1"}, stdout=out, stderr=err)
    assert code == 0, (out.getvalue()[-4000:], err.getvalue()[-3000:])
    results = H.parse_results(out.getvalue())
    assert sorted(results) == [0, 1], out.getvalue()[-3000:]
    for rank in (0, 1):
        assert results[rank]["has_value"] == [True] * 6 + [False, False]
        assert results[rank]["agreements"] == 8  # one per call, none more
        assert results[rank]["policy"] == "OFF"
        # The DDP habit: DistributedSampler(dataset) given to experimental_distribute_dataset.
        assert f"DistributedSampler(num_replicas=2, rank={rank})" in results[rank]["ddp_refused"]
        assert "sharded twice" in results[rank]["ddp_refused"]
        assert results[rank]["ddp_declared_rows"] == 4  # declared as the worker's share: half of 8
        # Loaders shuffled with the rank as seed: found at the first step, on both workers.
        assert "at step 0 of this epoch the workers read different global batches" in results[rank]["shuffled_by_rank"]
    assert results[0]["local_rows"] == [4] * 6  # 3 global batches of 8, 2 steps each
    assert results[1]["local_rows"] == [4] * 4 + [0, 0]  # ran out: empty batches while worker 0 has data
    assert results[0]["params"] == results[1]["params"]
    expected = _reference_fit()
    assert max(abs(a - b) for a, b in zip(results[0]["params"], expected, strict=True)) < 1e-6


def test_per_replica_mode_through_the_strategy():
    contexts = []
    options = td.InputOptions(experimental_replication_mode=PER_REPLICA)
    dist = mirrored(2).distribute_datasets_from_function(per_replica_fn(contexts), options)
    assert [(c.num_input_pipelines, c.input_pipeline_id) for c in contexts] == [(2, 0), (2, 1)]
    steps = list(dist)
    assert [[t.shape[0] for t in step.values] for step in steps] == [[4, 4], [4, 4], [4, 0]]
    assert torch.equal(torch.cat(list(steps[0].values)).reshape(-1), torch.arange(8, dtype=torch.float32))
