"""``InputContext``, ``ValueContext`` and ``InputOptions``: what an input pipeline is told."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from torch_distribute.errors import InvalidArgumentError


class InputContext:
    """Where an input pipeline sits: which of how many pipelines, for how many replicas.

    >>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    >>> ctx.get_per_replica_batch_size(64)
    16
    """

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1):
        for name, value in (
            ("num_input_pipelines", num_input_pipelines),
            ("num_replicas_in_sync", num_replicas_in_sync),
        ):
            if not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}.")
        if not isinstance(input_pipeline_id, int) or not 0 <= input_pipeline_id < num_input_pipelines:
            raise InvalidArgumentError(
                f"input_pipeline_id must be in [0, {num_input_pipelines}), got {input_pipeline_id!r}."
            )
        self.num_input_pipelines = num_input_pipelines
        self.input_pipeline_id = input_pipeline_id
        self.num_replicas_in_sync = num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size // num_replicas_in_sync``; it must divide evenly."""
        if not isinstance(global_batch_size, int) or global_batch_size < 0:
            raise InvalidArgumentError(f"global_batch_size must be a non-negative int, got {global_batch_size!r}.")
        if global_batch_size % self.num_replicas_in_sync:
            raise InvalidArgumentError(
                f"The global batch size ({global_batch_size}) is not divisible by the number of "
                f"replicas in sync ({self.num_replicas_in_sync}). Use a multiple of "
                f"{self.num_replicas_in_sync}, e.g. {self.num_replicas_in_sync * max(1, global_batch_size // self.num_replicas_in_sync)}."
            )
        return global_batch_size // self.num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self.num_input_pipelines}, "
            f"input_pipeline_id={self.input_pipeline_id}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


@dataclass(frozen=True)
class ValueContext:
    """Given to ``experimental_distribute_values_from_function``'s ``value_fn``."""

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1


class InputReplicationMode(enum.Enum):
    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


class AutoShardPolicy(enum.Enum):
    """How a dataset is split across workers (multi-worker strategies)."""

    AUTO = "AUTO"
    DATA = "DATA"
    FILE = "FILE"
    OFF = "OFF"


@dataclass(frozen=True)
class InputOptions:
    """Options for distributed datasets.

    ``experimental_fetch_to_device``: move each replica's batch to its device (default); with
    False batches stay on the host. ``auto_shard_policy`` is used by multi-worker strategies.
    TensorFlow's other three fields are accepted at their defaults only (what this library
    does); any other value raises ``InvalidArgumentError`` rather than being ignored.

    >>> InputOptions(experimental_per_replica_buffer_size=2)
    Traceback (most recent call last):
    ...
    torch_distribute.errors.InvalidArgumentError: InputOptions(experimental_per_replica_buffer_size=2) is not supported: batches are fetched one step ahead per replica (1). Leave it at 1.
    """

    experimental_fetch_to_device: bool = True
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1
    auto_shard_policy: AutoShardPolicy = AutoShardPolicy.AUTO

    def __post_init__(self) -> None:
        if self.experimental_replication_mode is not InputReplicationMode.PER_WORKER:
            raise InvalidArgumentError(
                f"InputOptions(experimental_replication_mode={self.experimental_replication_mode}) "
                "is not supported: the dataset function runs once per worker (PER_WORKER) and "
                "its batches are split across the local replicas. Leave the default."
            )
        if self.experimental_place_dataset_on_device:
            raise InvalidArgumentError(
                "InputOptions(experimental_place_dataset_on_device=True) is not supported: the "
                "input pipeline runs on the host and experimental_fetch_to_device=True (the "
                "default) moves each replica's batch to its device."
            )
        if self.experimental_per_replica_buffer_size != 1:
            raise InvalidArgumentError(
                f"InputOptions(experimental_per_replica_buffer_size="
                f"{self.experimental_per_replica_buffer_size}) is not supported: batches are "
                "fetched one step ahead per replica (1). Leave it at 1."
            )
