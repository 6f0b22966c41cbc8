"""Refuse a loader that already shards its examples (DDP's ``DistributedSampler``).

A DDP program gives each process its share of the examples with
``DataLoader(dataset, sampler=DistributedSampler(dataset))``. ``experimental_distribute_dataset``
splits every global batch across the replicas and workers itself, so such a loader is sharded
twice and one epoch silently sees ``1/num_replicas`` of the data. Any sampler with
``num_replicas`` and ``rank`` attributes counts (DDP's, Lightning's, torchdata's).

The one loader accepted: the user sharded per worker on purpose, declared with
``AutoShardPolicy.OFF`` (in the call's ``InputOptions`` or ``td.data.with_options``), and the
sampler's ``num_replicas``/``rank`` are the worker count and this worker's index. A sampler
with ``num_replicas=1`` shards nothing and is accepted too.

>>> import torch
>>> from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
>>> data = TensorDataset(torch.arange(8.0))
>>> loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=2, rank=0))
>>> sharding_sampler_of(loader) is loader.sampler
True
"""

from __future__ import annotations

from typing import Any

from torch_distribute.errors import DatasetError
from torch_distribute.input.input_context import AutoShardPolicy


def sharding_sampler_of(loader: Any) -> Any | None:
    """The sampler of ``loader`` (or of its ``batch_sampler``) that keeps one shard, or None."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    for sampler in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None), batch_sampler):
        if sampler is not None and hasattr(sampler, "num_replicas") and hasattr(sampler, "rank"):
            return sampler
    return None


def refuse_sharding_sampler(
    loader: Any, requested_policy: AutoShardPolicy | None, num_workers: int, worker_index: int
) -> None:
    """Raise ``DatasetError`` if ``loader`` (given to ``experimental_distribute_dataset``)
    already keeps only one shard of its dataset; ``requested_policy``: the call's or the
    dataset's own ``auto_shard_policy``, if any."""
    sampler = sharding_sampler_of(loader)
    if sampler is None:
        return
    shards, rank = getattr(sampler, "num_replicas", None), getattr(sampler, "rank", None)
    if not isinstance(shards, int) or shards <= 1:
        return
    if requested_policy is AutoShardPolicy.OFF and (shards, rank) == (num_workers, worker_index):
        return  # sharded per worker on purpose, and declared so
    name = type(sampler).__name__
    raise DatasetError(
        f"The DataLoader given to experimental_distribute_dataset uses {name}(num_replicas={shards}, "
        f"rank={rank}), which keeps only 1/{shards} of the dataset; experimental_distribute_dataset "
        f"then splits every batch across the replicas (and workers) itself, so the dataset "
        f"would be sharded twice and one epoch would see 1/{shards} of it. Either give "
        "experimental_distribute_dataset a loader with a plain sampler and the global batch size "
        "(DataLoader(dataset, batch_size=GLOBAL_BATCH_SIZE, shuffle=True)), or keep the "
        f"{name} and build the loader per input pipeline: "
        "strategy.distribute_datasets_from_function(lambda ctx: DataLoader(dataset, "
        "batch_size=ctx.get_per_replica_batch_size(GLOBAL_BATCH_SIZE), "
        f"sampler={name}(dataset, num_replicas=ctx.num_input_pipelines, rank=ctx.input_pipeline_id)))."
    )
