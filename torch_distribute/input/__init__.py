"""Distributed input: split global batches across replicas, or one pipeline per replica."""

from torch_distribute.input import dataset_options as data
from torch_distribute.input import step_agreement, step_rows
from torch_distribute.input.batching import batch_sizes_for_worker
from torch_distribute.input.distributed_dataset import (
    DatasetFromFunction,
    DistributedDataset,
    DistributedIterator,
)
from torch_distribute.input.element_spec import TensorSpec
from torch_distribute.input.input_context import (
    AutoShardPolicy,
    InputContext,
    InputOptions,
    InputReplicationMode,
    ValueContext,
)
from torch_distribute.input.optional import Optional

__all__ = [
    "AutoShardPolicy",
    "DatasetFromFunction",
    "DistributedDataset",
    "DistributedIterator",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "Optional",
    "TensorSpec",
    "ValueContext",
    "batch_sizes_for_worker",
    "data",
    "step_agreement",
    "step_rows",
]
