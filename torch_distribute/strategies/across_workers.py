"""The cross-worker half of ``StrategyExtended`` for strategies with one process per worker.

``MultiWorkerMirroredStrategy`` and ``FullyShardedStrategy`` both keep a ``WorkerGroup`` (a
``FaultTolerantGroup`` under fault tolerance, whose membership changes between steps) and
answer the contract's topology and cross-worker calls the same way: through the group when
there are several workers, locally when there is one. A strategy mixes this in before its
``StrategyExtended`` base, calls ``_take_place(resolver)`` and sets ``_group`` (a
``WorkerGroup``, from ``open_worker_group``, or None for a single worker).

Their constructors share the rest too: ``worker_job`` (the cluster, and the communication
options checked) and ``default_worker_devices``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from torch_distribute.cluster import ClusterResolver, ProcessGroupClusterResolver, resolve_cluster
from torch_distribute.collectives.communication import (
    CommunicationImplementation,
    CommunicationOptions,
)
from torch_distribute.collectives.fault_tolerant_group import FaultTolerantGroup
from torch_distribute.collectives.worker_group import WorkerGroup
from torch_distribute.devices import LogicalDevice, gpu_identity, local_devices
from torch_distribute.errors import ClusterConfigError, InvalidArgumentError
from torch_distribute.input.step_agreement import StepReport

_DATA_AGREEMENT = "input agreement (which workers still have data, and how many rows?)"


class AcrossWorkers:
    """Topology and cross-worker collectives over ``self._group`` (see the module docstring)."""

    _num_workers: int
    _worker_index: int
    _is_chief: bool
    _group: WorkerGroup | FaultTolerantGroup | None

    def _take_place(self, resolver: ClusterResolver) -> None:
        """This worker's place in the cluster: how many workers, which one, the chief or not."""
        self._num_workers = resolver.num_workers
        self._worker_index = resolver.worker_index
        self._is_chief = resolver.is_chief

    @property
    def num_workers_in_sync(self) -> int:
        return self._num_workers

    @property
    def worker_index(self) -> int:
        return self._worker_index

    @property
    def is_chief(self) -> bool:
        return self._is_chief

    def _peers(self) -> WorkerGroup | FaultTolerantGroup | None:
        """The group when there are other workers to talk to; None alone."""
        return self._group if self._num_workers > 1 else None

    def reduce_across_workers(self, tensor: torch.Tensor) -> torch.Tensor:
        group = self._peers()
        return tensor if group is None else group.all_reduce_(tensor.detach().clone(), what="reduce")

    def gather_across_workers(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        group = self._peers()
        return tensor if group is None else group.all_gather_along(tensor.detach(), axis, what="gather")

    def any_worker_has_data(self, local_has_data: bool) -> bool:
        group = self._peers()
        return local_has_data if group is None else group.any_true(local_has_data, what=_DATA_AGREEMENT)

    def gather_input_reports(self, report: StepReport) -> list[StepReport]:
        group = self._peers()
        if group is None:
            return [report]
        return [StepReport.unpack(payload) for payload in group.gather_small(report.pack(), what=_DATA_AGREEMENT)]

    def all_gather_objects(self, obj: Any, what: str) -> list[Any]:
        group = self._peers()
        return [obj] if group is None else group.all_gather_objects(obj, what=what)


def strategy_cluster(cluster_resolver: ClusterResolver | None) -> ClusterResolver:
    """The cluster a strategy with one process per worker runs on.

    When ``torch.distributed`` is already initialized (Ray Train, accelerate, Lightning, the
    user's own ``init_process_group``), that group's world size and rank: a given
    ``cluster_resolver`` must agree with them. Otherwise ``cluster_resolver``, else the
    environment's (``resolve_cluster()``).

    Raises:
        ClusterConfigError: the given resolver disagrees with the existing group, or the
            environment is incomplete or inconsistent.
    """
    if dist.is_available() and dist.is_initialized():
        adopted = ProcessGroupClusterResolver.from_initialized()
        if cluster_resolver is None:
            return adopted
        given = (cluster_resolver.num_workers, cluster_resolver.worker_index)
        if given != (adopted.num_workers, adopted.worker_index):
            raise ClusterConfigError(
                f"torch.distributed is already initialized with {adopted.num_workers} processes (this "
                f"one is rank {adopted.worker_index}), but cluster_resolver makes this worker "
                f"{given[1]} of {given[0]}: pass no cluster_resolver to use the existing group"
            )
        return cluster_resolver
    resolver = cluster_resolver or resolve_cluster()
    resolver.validate()
    return resolver


def worker_job(
    cluster_resolver: ClusterResolver | None, communication_options: CommunicationOptions | None
) -> tuple[ClusterResolver, CommunicationOptions]:
    """The cluster (``strategy_cluster``) and the communication options (the defaults for
    None) a strategy with one process per worker runs with.

    Raises:
        ClusterConfigError: as ``strategy_cluster``.
        InvalidArgumentError: ``communication_options`` is not a ``CommunicationOptions``.
    """
    resolver = strategy_cluster(cluster_resolver)
    options = communication_options or CommunicationOptions()
    if not isinstance(options, CommunicationOptions):
        raise InvalidArgumentError(
            f"communication_options must be td.CommunicationOptions, got {type(options).__name__}."
        )
    return resolver, options


def check_implementation(options: CommunicationOptions, devices: Sequence[LogicalDevice]) -> None:
    """``CommunicationImplementation.NCCL`` needs GPUs, with one worker as with several
    (TensorFlow only warns, then falls back; several workers here raise the same error at the
    rendezvous).

    Raises:
        InvalidArgumentError: NCCL asked for, and no device is a GPU.
    """
    if options.implementation is CommunicationImplementation.NCCL and not any(d.is_cuda for d in devices):
        raise InvalidArgumentError(
            "CommunicationImplementation.NCCL needs CUDA devices, and this worker's devices are "
            f"{[d.name for d in devices]}: NCCL does not run on CPUs. Use "
            "CommunicationImplementation.AUTO (NCCL on GPUs, Gloo on CPUs) or RING."
        )


def open_worker_group(
    resolver: ClusterResolver, options: CommunicationOptions, devices: Sequence[LogicalDevice], strategy: str
) -> WorkerGroup:
    """The ``WorkerGroup`` of this worker's ``strategy`` (its class name), meeting the others at
    the cluster's rendezvous address."""
    host, port = resolver.rendezvous_address()
    return WorkerGroup(
        host, port, resolver.num_workers, resolver.worker_index, options,
        gpus=sorted({gpu_identity(d) for d in devices if d.is_cuda}),
        strategy=strategy, peer_addresses=peer_addresses(resolver),
    )


def default_worker_devices(resolver: ClusterResolver) -> tuple[LogicalDevice, ...]:
    """All visible GPUs, or this process's GPU when several workers share a machine."""
    devices = local_devices()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if devices[0].is_cuda and local_world > 1:
        local_rank = getattr(resolver, "local_rank", None) or int(os.environ.get("LOCAL_RANK", "0"))
        return (devices[local_rank % len(devices)],)
    return devices


def peer_addresses(resolver: ClusterResolver) -> list[str]:
    """Each worker's address in worker-index order (chief first), where the cluster lists
    real ones: what the "waiting for workers" line names."""
    spec = resolver.cluster_spec()
    return [spec.task_address(job, index) for job in ("chief", "worker") if job in spec.jobs
            for index in spec.task_indices(job)]
