"""Habits from DDP and Keras, written as their users write them: each is either refused or
warned about with a message that says what to write instead, and the form it names trains
as one device does (2 CPU replicas against one device, same global batch)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import torch_distribute as td

pytestmark = pytest.mark.timeout(120)

GLOBAL_BATCH = 8


def two_replicas() -> td.MirroredStrategy:
    return td.MirroredStrategy(["cpu:0", "cpu:1"])


def examples(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def train(strategy, batches, global_batch_size=GLOBAL_BATCH, seed=0):
    """A custom loop over ``batches`` (a distributed dataset); the parameters after it."""
    torch.manual_seed(seed)
    with strategy.scope():
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def step(x, y):
        opt.zero_grad()
        per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = td.compute_average_loss(per_example, global_batch_size=global_batch_size)
        loss.backward()
        opt.step()
        return loss

    for x, y in batches:
        strategy.run(step, args=(x, y))
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# -- a DistributedSampler given to experimental_distribute_dataset --------------------------------


def test_a_ddp_loader_with_distributed_sampler_is_refused_and_the_named_forms_train_as_one_device():
    strategy = two_replicas()
    data = examples()
    # What a DDP user writes: each process (here: replica) samples its shard.
    sampler = DistributedSampler(data, num_replicas=strategy.num_replicas_in_sync, rank=0, shuffle=False)
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // 2, sampler=sampler)
    with pytest.raises(td.DatasetError) as info:
        strategy.experimental_distribute_dataset(loader)
    message = str(info.value)
    assert "DistributedSampler(num_replicas=2, rank=0)" in message and "sharded twice" in message
    assert "distribute_datasets_from_function" in message and "ctx.num_input_pipelines" in message
    assert "plain sampler" in message
    assert isinstance(info.value, td.DistributeError)
    # The batch_sampler form is caught too.
    batched = DataLoader(data, batch_sampler=torch.utils.data.BatchSampler(sampler, 4, drop_last=False))
    with pytest.raises(td.DatasetError, match="sharded twice"):
        strategy.experimental_distribute_dataset(batched)

    one_device = train(td.OneDeviceStrategy("cpu"), DataLoader(data, batch_size=GLOBAL_BATCH))
    # 1. A plain loader of global batches.
    plain = strategy.experimental_distribute_dataset(DataLoader(data, batch_size=GLOBAL_BATCH))
    torch.testing.assert_close(train(strategy, plain), one_device)

    # 2. The DistributedSampler kept, one loader per input pipeline (one per worker here),
    # each replica taking its own consecutive per-replica batches.
    def dataset_fn(ctx):
        shard = DistributedSampler(data, num_replicas=ctx.num_input_pipelines, rank=ctx.input_pipeline_id,
                                   shuffle=False)
        return DataLoader(data, batch_size=ctx.get_per_replica_batch_size(GLOBAL_BATCH), sampler=shard)

    torch.testing.assert_close(train(strategy, strategy.distribute_datasets_from_function(dataset_fn)), one_device)


def test_a_sampler_declared_as_this_workers_shard_with_auto_shard_policy_off_is_accepted():
    data = examples()
    strategy = td.OneDeviceStrategy("cpu")
    options = td.InputOptions(auto_shard_policy=td.AutoShardPolicy.OFF)
    # One worker: num_replicas=1 shards nothing; a sampler of 2 shards without OFF is refused.
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, num_replicas=1, rank=0))
    assert sum(len(y) for _, y in strategy.experimental_distribute_dataset(loader)) == len(data)
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    with pytest.raises(td.DatasetError, match="sharded twice"):
        strategy.experimental_distribute_dataset(loader, options)
