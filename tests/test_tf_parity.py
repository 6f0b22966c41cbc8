"""Where a TensorFlow port used to differ silently (issue 41), checked in one process: what the
workers' per-step exchange concludes, the loss checks it feeds, and TensorFlow's contexts,
exceptions and names. The guides' cells themselves are ported in test_tf_guide_*.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torch_distribute as td
from torch_distribute.input import DatasetFromFunction, DistributedDataset
from torch_distribute.input.step_agreement import StepReport, batch_digest

CPU2 = [torch.device("cpu")] * 2


def other_worker(*reports: StepReport):
    """A stand-in for ``extended.gather_input_reports``: this worker's report, then another
    worker's, scripted step by step."""
    scripted = iter(reports)

    def sync(report: StepReport) -> list[StepReport]:
        return [report, next(scripted)]

    return sync


# -- the per-step exchange -------------------------------------------------------------------


def test_file_sharding_that_leaves_a_worker_without_data_fails_on_every_worker_at_the_first_step():
    class OneFile(list):
        def shard(self, num_shards: int, index: int) -> OneFile:
            return OneFile(self[index::num_shards])

    options = td.InputOptions(auto_shard_policy=td.AutoShardPolicy.FILE)
    # Worker 0 has the only file; worker 1 reports no data: both raise at the same step.
    worker0 = DistributedDataset(OneFile([torch.arange(4)]), CPU2, num_workers=2, worker_index=0, options=options,
                                 sync_step=other_worker(StepReport(False, 0, 0)))
    with pytest.raises(td.DatasetError, match="FILE gave worker 1 no data at all.*AutoShardPolicy.DATA"):
        next(iter(worker0))
    worker1 = DistributedDataset(OneFile([torch.arange(4)]), CPU2, num_workers=2, worker_index=1, options=options,
                                 sync_step=lambda report: [StepReport(True, 2, 0), report])
    with pytest.raises(td.DatasetError, match="FILE gave worker 1 no data at all"):
        next(iter(worker1))


def test_data_workers_whose_loaders_shuffle_differently_are_named_with_the_fix():
    data = TensorDataset(torch.arange(32.0).reshape(16, 2))

    def loader(seed: int) -> DataLoader:
        return DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(seed))

    # The other worker's first global batch, as its loader shuffled it.
    theirs = batch_digest(next(iter(loader(1))))
    same = DistributedDataset(loader(1), CPU2, num_workers=2, worker_index=0,
                              sync_step=other_worker(StepReport(True, 2, theirs)))
    next(iter(same))  # the same seed: the same global batch
    differ = DistributedDataset(loader(0), CPU2, num_workers=2, worker_index=0,
                                sync_step=other_worker(StepReport(True, 2, theirs)))
    with pytest.raises(td.DatasetError, match="shuffle in different orders.*manual_seed"):
        next(iter(differ))


def test_only_the_first_steps_of_each_epoch_carry_a_digest():
    seen: list[int] = []

    def sync(report: StepReport) -> list[StepReport]:
        seen.append(report.digest)
        return [report, report]

    dataset = DistributedDataset([torch.arange(4.0)] * 4, CPU2, num_workers=2, worker_index=0, sync_step=sync)
    for _ in range(2):
        assert len(list(dataset)) == 4
    digested = [bool(d) for d in seen]
    assert digested == ([True, True, False, False, False] * 2)  # 4 steps and the end, twice


def test_a_worker_without_any_batch_while_others_have_data_fails_everywhere():
    dataset = DatasetFromFunction([], CPU2, sync_step=other_worker(StepReport(True, 4, 0)))
    with pytest.raises(td.DatasetError, match="worker 0 produced no batch at all"):
        next(iter(dataset))


# -- compute_average_loss and the step's rows -------------------------------------------------


def test_a_dataset_function_batched_by_the_global_batch_is_refused_before_the_update():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    global_batch = 8
    with strategy.scope():
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()

    def step(x):
        loss = td.compute_average_loss(model(x).squeeze(1), global_batch_size=global_batch)
        loss.backward()
        optimizer.step()

    # The mistake: each replica's batch holds the whole global batch (2 x 8 rows a step).
    wrong = strategy.distribute_datasets_from_function(lambda ctx: [torch.ones(global_batch, 2)] * 2)
    with pytest.raises(td.LossScalingError, match=r"global_batch_size=8\) on a step whose batches hold 16 rows"):
        strategy.run(step, args=(next(iter(wrong)),))
    assert torch.equal(model.weight.detach(), before)
    right = strategy.distribute_datasets_from_function(
        lambda ctx: [torch.ones(ctx.get_per_replica_batch_size(global_batch), 2)] * 2)
    for x in right:
        strategy.run(step, args=(x,))


def test_a_short_step_that_is_not_the_last_warns_once_for_the_line():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = torch.nn.Linear(2, 1)

    def step(x):
        return td.compute_average_loss(model(x).squeeze(1), global_batch_size=8)

    # Batches of 4 rows (per worker, say) while global_batch_size counts 8.
    batches = strategy.experimental_distribute_dataset([torch.ones(4, 2)] * 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            for x in batches:
                strategy.run(step, args=(x,))
    short = [w for w in caught if "whose batches held 4 rows" in str(w.message)]
    assert len(short) == 1, [str(w.message) for w in caught]
    assert "weighed 1/8 instead of 1/4" in str(short[0].message)
    # A ragged last batch is not a short step: no warning.
    ragged = strategy.experimental_distribute_dataset([torch.ones(8, 2), torch.ones(4, 2)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x in ragged:
            strategy.run(step, args=(x,))


# -- TensorFlow's contexts, exceptions and names ---------------------------------------------


def test_the_default_strategys_scope_is_a_replica_context_as_in_tensorflow():
    default = td.get_strategy()
    with default.scope():
        assert td.in_cross_replica_context() is False
        assert td.get_replica_context() is not None
        assert td.get_replica_context().replica_id_in_sync_group == 0
        assert float(default.reduce("SUM", 1.0, axis=None)) == 1.0
    assert td.in_cross_replica_context() is False


def test_get_next_past_the_end_raises_out_of_range_and_next_stop_iteration():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    iterator = iter(strategy.experimental_distribute_dataset([torch.arange(4)]))
    iterator.get_next()
    with pytest.raises(td.OutOfRangeError, match="get_next_as_optional"):
        iterator.get_next()
    iterator = iter(strategy.experimental_distribute_dataset([torch.arange(4)]))
    next(iterator)
    with pytest.raises(StopIteration):
        next(iterator)


def test_input_signature_refuses_another_structure_with_a_type_error():
    @td.function(input_signature=[td.TensorSpec((None,), torch.float32)])
    def double(x):
        return x * 2

    with pytest.raises(TypeError, match="structure"):
        double((torch.ones(2), torch.ones(2)))
    with pytest.raises(td.InputSignatureError, match="does not match its input_signature"):
        double(torch.ones(2, 2))


def test_nccl_on_a_cpu_worker_is_refused_naming_the_fix():
    nccl = td.CommunicationOptions(implementation=td.CommunicationImplementation.NCCL)
    with pytest.raises(td.InvalidArgumentError, match="NCCL needs CUDA devices.*AUTO"):
        td.MultiWorkerMirroredStrategy(communication_options=nccl)


def test_data_parallel_wrappers_made_in_a_scope_are_refused():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with pytest.raises(td.InvalidArgumentError, match="DataParallel was made inside MirroredStrategy.scope.*Drop the wrapper"):
        with strategy.scope():
            torch.nn.DataParallel(torch.nn.Linear(2, 2))


def test_tensorflows_experimental_names_are_the_stable_ones():
    assert td.experimental.CommunicationOptions is td.CommunicationOptions
    assert td.experimental.CommunicationImplementation is td.CommunicationImplementation
    assert td.experimental.CentralStorageStrategy is td.CentralStorageStrategy
    assert td.experimental.ParameterServerStrategy is td.ParameterServerStrategy
    assert td.experimental.MultiWorkerMirroredStrategy is td.MultiWorkerMirroredStrategy
    assert td.experimental.coordinator.ClusterCoordinator is td.coordinator.ClusterCoordinator
    assert td.experimental.ValueContext is td.ValueContext
    assert td.data.experimental.AutoShardPolicy is td.AutoShardPolicy


def test_values_from_a_function_returning_a_nest_run_and_reduce_as_in_tensorflow():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: (torch.tensor(ctx.replica_id_in_sync_group), {"a": torch.tensor(1.0)}))
    assert isinstance(values, tuple) and isinstance(values[0], td.PerReplica)
    assert isinstance(values[1]["a"], td.PerReplica)
    out = strategy.run(lambda x, y: x + 1, args=values)
    assert [int(v) for v in strategy.experimental_local_results(out)] == [1, 2]
    total = strategy.reduce("SUM", values, axis=None)
    assert int(total[0]) == 1 and float(total[1]["a"]) == 2.0


def test_run_functions_eagerly_runs_td_functions_and_their_replica_steps_uncompiled():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    seen = []

    @td.function
    def step(x):
        return strategy.run(lambda v: seen.append(torch.compiler.is_compiling()) or v * 2, args=(x,))

    td.config.run_functions_eagerly(True)
    try:
        assert td.config.functions_run_eagerly()
        out = step(strategy.experimental_distribute_values_from_function(lambda ctx: torch.ones(1)))
    finally:
        td.config.run_functions_eagerly(False)
    assert seen == [False, False] and step.experimental_get_tracing_count() == 0
    assert [float(v) for v in strategy.experimental_local_results(out)] == [2.0, 2.0]
    with pytest.raises(td.InvalidArgumentError, match="True or False"):
        td.config.run_functions_eagerly("yes")
