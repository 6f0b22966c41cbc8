"""``MultiWorkerMirroredStrategy``: synchronous training over several worker processes.

Each worker drives its local devices exactly as ``MirroredStrategy`` does; across workers,
everything goes through ``torch.distributed`` (Gloo on CPU, NCCL for CUDA tensors):
initial values are broadcast from the chief, gradients are summed in buckets launched while
backward runs (local replicas summed first, then one all-reduce per bucket), and
``reduce``/``gather``/``all_reduce``/metrics span every replica of every worker.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_distribute.cluster import ClusterResolver
from torch_distribute.collectives.communication import CommunicationOptions
from torch_distribute.collectives.worker_group import WorkerGroup
from torch_distribute.devices import (
    DeviceLike,
    LogicalDevice,
    canonicalize_all,
)
from torch_distribute.errors import InvalidArgumentError
from torch_distribute.replica_context import ReplicaContext
from torch_distribute.strategies.across_workers import (
    AcrossWorkers,
    check_implementation,
    default_worker_devices,
    open_worker_group,
    worker_job,
)
from torch_distribute.strategies.base import Strategy
from torch_distribute.strategies.gradient_sync import GradientSynchronizer
from torch_distribute.strategies.mirrored import MirroredExtended
from torch_distribute.strategies.replicated_state import MirroredTensor
from torch_distribute.strategies.single_replica import call_on_this_thread


class MultiWorkerMirroredExtended(AcrossWorkers, MirroredExtended):
    """The mirrored family across worker processes, through the family's hooks: one local
    replica runs in the calling thread (``_run_replicas``), gradients are summed over the
    workers in buckets (``_reduce_gradients``), only worker 0 keeps the sum after the step
    (``_after_optimizer_step``), non-finite reports are gathered from every worker.

    >>> import torch_distribute as td
    >>> td.MultiWorkerMirroredStrategy().extended.worker_group is None   # one local worker
    True
    """

    def __init__(
        self,
        strategy: Strategy,
        devices: tuple[LogicalDevice, ...],
        resolver: ClusterResolver,
        options: CommunicationOptions,
    ):
        super().__init__(strategy, devices, None)
        self._resolver = resolver
        self._options = options
        self._take_place(resolver)
        self._group: WorkerGroup | None = None
        self._synchronizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, GradientSynchronizer] = (
            weakref.WeakKeyDictionary()
        )
        if self._num_workers > 1:
            self._group = open_worker_group(resolver, options, devices, type(strategy).__name__)
            counts = self._group.all_gather_objects(len(devices), what="start-up check")
            if len(set(counts)) != 1:
                self._group.close()
                raise InvalidArgumentError(
                    f"Workers drive different numbers of local replicas {counts}; every worker "
                    "needs the same number (the same GPU count, or the same devices=...)."
                )
            self._state.worker_broadcast = self._broadcast_from_chief
            self._state.worker_mean = self._mean_over_workers
        self._single_replica_context = ReplicaContext(strategy, self.replica_id_offset)

    # -- topology --------------------------------------------------------------------------
    @property
    def worker_group(self) -> WorkerGroup | None:
        return self._group

    # -- running -----------------------------------------------------------------------------
    def call_for_each_replica(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self._group is not None:
            self._group.begin_run()
        result = super().call_for_each_replica(fn, args, kwargs)
        for synchronizer in self._synchronizers.values():
            synchronizer.attach_hooks()
        return result

    def _run_replicas(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self.num_local_replicas > 1:
            return super()._run_replicas(fn, args, kwargs)
        # One local replica: run in this thread, like DDP (no thread hand-off, no mode).
        return call_on_this_thread(self._single_replica_context, self.primary_device, fn, args, kwargs)

    # -- across workers (AcrossWorkers) -----------------------------------------------------
    @property
    def coordination_store(self) -> Any | None:
        return self._group.store if self._group is not None else None

    def _broadcast_from_chief(self, tensors: list[torch.Tensor]) -> None:
        self._group.broadcast_packed_(tensors, src=0, what="initial broadcast from the chief")

    def _mean_over_workers(self, tensors: list[torch.Tensor]) -> None:
        self._group.average_packed_(tensors, what="buffer average")

    # -- gradients (the mirrored family's hooks) ------------------------------------------------
    def _reduce_gradients(self, optimizer: torch.optim.Optimizer, records: list[MirroredTensor]) -> None:
        if self._group is None:
            super()._reduce_gradients(optimizer, records)
            return
        synchronizer = self._synchronizers.get(optimizer)
        if synchronizer is None:
            synchronizer = GradientSynchronizer(
                self._state, records, self._group, len(self.worker_devices), self._options.bucket_bytes
            )
            self._synchronizers[optimizer] = synchronizer
            synchronizer.attach_hooks()
        synchronizer.finish()

    def _gather_nonfinite(self, local: list[tuple[int, float]]) -> list[list[tuple[int, float]]]:
        if self._group is None:
            return [local]
        return self._group.all_gather_objects(local, what="non-finite gradient report")

    def _after_optimizer_step(self, records: list[MirroredTensor]) -> None:
        # Worker 0 keeps the summed gradient; the others drop it, so gradients accumulated
        # over several steps without zero_grad are still summed once.
        if self._group is not None and self._worker_index != 0:
            for record in records:
                record.live_primary().grad = None


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism over worker processes (one per machine or per GPU).

    The cluster comes from an existing ``torch.distributed`` process group (Ray Train,
    accelerate, the user's own ``init_process_group``: its world and rank are used and it is
    never destroyed here), else ``cluster_resolver``, else the environment
    (``resolve_cluster``: ``TF_CONFIG``, torchrun's variables, MPI, SLURM, Kubeflow); with
    none, a single local worker. Start the same script once per worker
    (``torch-distribute launch --nproc 2 train.py``, torchrun, mpirun, srun, or a TF_CONFIG
    per process); see ``docs/launchers.md``.

    >>> import torch_distribute as td
    >>> strategy = td.MultiWorkerMirroredStrategy()   # no cluster: one local worker
    >>> strategy.num_replicas_in_sync
    1
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        devices: Sequence[DeviceLike] | None = None,
    ):
        resolver, options = worker_job(cluster_resolver, communication_options)
        parsed = canonicalize_all(devices) if devices is not None else default_worker_devices(resolver)
        check_implementation(options, parsed)
        self._cluster_resolver = resolver
        super().__init__(MultiWorkerMirroredExtended(self, parsed, resolver, options))

    @property
    def cluster_resolver(self) -> ClusterResolver:
        return self._cluster_resolver
