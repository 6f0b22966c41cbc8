"""``MultiWorkerMirroredStrategy``: synchronous training over several worker processes.

Each worker drives its local devices exactly as ``MirroredStrategy`` does; across workers,
everything goes through ``torch.distributed`` (Gloo on CPU, NCCL for CUDA tensors):
initial values are broadcast from the chief, gradients are summed in buckets launched while
backward runs (local replicas summed first, then one all-reduce per bucket), and
``reduce``/``gather``/``all_reduce``/metrics span every replica of every worker.

With ``fault_tolerance=td.experimental.FaultTolerance(...)`` the workers are those of each
step's quorum instead (``fault_tolerant.py``): the collectives run on a
``FaultTolerantGroup``, a step's optimizer update is applied only when torchft commits it
(``_commit_step``), and a worker that joins receives this strategy's captured state
(``recovery_state``) from a live one.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from torch_distribute import context
from torch_distribute.cluster import ClusterResolver
from torch_distribute.collectives.communication import CommunicationOptions
from torch_distribute.collectives.fault_tolerant_group import FaultTolerantGroup
from torch_distribute.collectives.worker_group import WorkerGroup
from torch_distribute.devices import (
    DeviceLike,
    LogicalDevice,
    canonicalize_all,
)
from torch_distribute.errors import FaultToleranceError, InvalidArgumentError
from torch_distribute.input import (
    DatasetFromFunction,
    DistributedDataset,
    InputContext,
    InputOptions,
)
from torch_distribute.replica_context import ReplicaContext
from torch_distribute.strategies.across_workers import (
    AcrossWorkers,
    check_implementation,
    default_worker_devices,
    open_worker_group,
    worker_job,
)
from torch_distribute.strategies.base import Strategy
from torch_distribute.strategies.fault_tolerant import FaultTolerance, FaultTolerantTraining
from torch_distribute.strategies.fault_tolerant_data import fault_tolerant_dataset, store_host
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
        fault_tolerance: FaultTolerance | None = None,
    ):
        super().__init__(strategy, devices, None)
        self._resolver = resolver
        self._options = options
        self._take_place(resolver)
        self._group: WorkerGroup | FaultTolerantGroup | None = None
        self._synchronizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, GradientSynchronizer] = (
            weakref.WeakKeyDictionary()
        )
        self._ft: FaultTolerantTraining | None = None
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self._schedulers: list[weakref.ref[Any]] = []
        self._committed: bool | None = None  # this step's verdict, once its optimizer stepped
        self._buffers_before: list[torch.Tensor] = []
        if fault_tolerance is not None:
            self._start_fault_tolerance(fault_tolerance, type(strategy).__name__)
        elif self._num_workers > 1:
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

    # -- fault tolerance ---------------------------------------------------------------------
    def _start_fault_tolerance(self, fault_tolerance: FaultTolerance, what: str) -> None:
        if not isinstance(fault_tolerance, FaultTolerance):
            raise InvalidArgumentError(
                f"fault_tolerance must be a td.experimental.FaultTolerance, got {type(fault_tolerance).__name__}.")
        if self.num_local_replicas != 1:
            raise FaultToleranceError(
                f"Under FaultTolerance each worker drives one device; this one has {self.num_local_replicas} "
                "(pass devices=[...] with one device, or start one worker per GPU).")
        self._ft = FaultTolerantTraining(
            fault_tolerance, slot=self._worker_index, num_slots=self._num_workers,
            host=store_host(fault_tolerance.lighthouse), verify=self._options.verify_collectives,
            what=what, state=self, on_membership=self._on_quorum, on_dropped=self._drop_step)
        self._group = self._ft.group
        # No broadcast from the chief: at the first quorum every worker takes the state of
        # the quorum's first one (torchft's init_sync). A module made after that is refused.
        self._state.worker_broadcast = self._refuse_late_tensors
        self._state.worker_mean = self._mean_over_workers

    @property
    def fault_tolerance(self) -> FaultTolerantTraining | None:
        """The fault-tolerant steps of this strategy (None without ``fault_tolerance``)."""
        return self._ft

    def _on_quorum(self, world_size: int, rank: int) -> None:
        """A new step's quorum: topology follows it; the buffers are kept, to be put back if
        the step is dropped (a batch-norm's statistics move in the forward)."""
        self._num_workers, self._worker_index, self._is_chief = world_size, rank, rank == 0
        self._single_replica_context = ReplicaContext(self._strategy, self.replica_id_offset)
        self._committed = None
        with torch.no_grad():
            self._buffers_before = [r.live_primary().clone() for r in self._state.records() if r.is_buffer]

    def _refuse_late_tensors(self, tensors: list[torch.Tensor]) -> None:
        if self._ft is not None and self._ft.group.quorum_id >= 0:
            raise FaultToleranceError(
                "A module was made in strategy.scope() after fault-tolerant training started: a worker that "
                "joins later would not have it. Make every module before the first step.")

    def recovery_state(self) -> dict[str, Any]:
        """What a joining worker receives: every captured tensor, optimizer and scheduler."""
        return {
            "tensors": [r.live_primary().detach() for r in self._state.records()],
            "optimizers": [o.state_dict() for o in _alive(self._optimizers)],
            # A scheduler's state is its __dict__: without the step this strategy routes.
            "schedulers": [{k: v for k, v in s.state_dict().items() if not callable(v)}
                           for s in _alive(self._schedulers)],
        }

    def load_recovery_state(self, state: dict[str, Any]) -> None:
        records = self._state.records()
        tensors = state["tensors"]
        mine = [tuple(r.live_primary().shape) for r in records]
        theirs = [tuple(t.shape) for t in tensors]
        optimizers, schedulers = _alive(self._optimizers), _alive(self._schedulers)
        if mine != theirs or len(optimizers) != len(state["optimizers"]) or len(schedulers) != len(state["schedulers"]):
            raise FaultToleranceError(
                f"This worker built other models than the running job's ({len(mine)} tensors, {len(optimizers)} "
                f"optimizers, {len(schedulers)} schedulers; the job has {len(theirs)}, {len(state['optimizers'])}, "
                f"{len(state['schedulers'])}): every worker must run the same program.")
        with torch.no_grad():
            for record, tensor in zip(records, tensors, strict=True):
                record.live_primary().copy_(tensor)
        for optimizer, optimizer_state in zip(optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(optimizer_state)
        for scheduler, scheduler_state in zip(schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(scheduler_state)

    def _commit_step(self, records: list[MirroredTensor]) -> bool:
        if self._ft is None:
            return True
        self._committed = self._ft.commit()
        if not self._committed:
            self._drop_step()
        return self._committed

    def _drop_step(self) -> None:
        """A step that is not committed leaves nothing: its gradients go, and the buffers
        (a batch-norm's statistics) are put back as they were at its quorum."""
        with torch.no_grad():
            for record in self._state.records():
                primary = record.live_primary()
                if primary.grad is not None:
                    primary.grad = None
            buffers = [r.live_primary() for r in self._state.records() if r.is_buffer]
            for buffer, before in zip(buffers, self._buffers_before, strict=False):
                buffer.copy_(before)

    def scheduler_step(self, scheduler: Any, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self._committed is False and context.get_replica_context() is not None:
            return None  # inside the step that was dropped: its schedule does not move either
        return super().scheduler_step(scheduler, step, args, kwargs)

    def scaler_update(self, scaler: Any, update: Callable[..., Any]) -> Any:
        if self._committed is False:
            # The step was dropped: its inf/NaN findings (this worker's own sums) do not move
            # the loss scale, which stays the same on every worker.
            return update(new_scale=scaler.get_scale())
        return super().scaler_update(scaler, update)

    def capture_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        super().capture_optimizer(optimizer)
        self._optimizers.append(weakref.ref(optimizer))

    def capture_scheduler(self, scheduler: Any) -> None:
        super().capture_scheduler(scheduler)
        self._schedulers.append(weakref.ref(scheduler))

    def live_dataset(self, dataset: Iterable[Any], options: InputOptions | None) -> DistributedDataset | None:
        """Under fault tolerance: ``dataset`` cut at every step by its live workers (else None:
        the strategy's usual distributed dataset)."""
        if self._ft is None:
            return None
        return fault_tolerant_dataset(self._ft, dataset, list(self.replica_devices), options, self.gather_input_reports)

    # -- topology --------------------------------------------------------------------------
    @property
    def worker_group(self) -> WorkerGroup | FaultTolerantGroup | None:
        return self._group

    # -- running -----------------------------------------------------------------------------
    @property
    def intercepts_optimizer_steps(self) -> bool:
        # Under fault tolerance every optimizer step waits for torchft's verdict, even alone.
        return self._ft is not None or super().intercepts_optimizer_steps

    def call_for_each_replica(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self._ft is not None:
            self._ft.begin_step(reading=False)
        if self._group is not None:
            self._group.begin_run()
        try:
            result = super().call_for_each_replica(fn, args, kwargs)
        finally:
            if self._ft is not None:
                self._ft.end_run()
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
        if self._ft is not None and self._group.world_size == 1:
            synchronizer.finish_alone()
        else:
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


def _alive(refs: list[weakref.ref[Any]]) -> list[Any]:
    return [obj for ref in refs if (obj := ref()) is not None]


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
        fault_tolerance: FaultTolerance | None = None,
    ):
        resolver, options = worker_job(cluster_resolver, communication_options)
        parsed = canonicalize_all(devices) if devices is not None else default_worker_devices(resolver)
        check_implementation(options, parsed)
        self._cluster_resolver = resolver
        super().__init__(MultiWorkerMirroredExtended(self, parsed, resolver, options, fault_tolerance))

    def experimental_distribute_dataset(self, dataset: Iterable[Any], options: InputOptions | None = None) -> DistributedDataset:
        """Split every *global* batch of ``dataset`` across the replicas (under fault
        tolerance: across the workers of each step, ``fault_tolerant_data.py``)."""
        extended = self.extended
        assert isinstance(extended, MultiWorkerMirroredExtended)
        live = extended.live_dataset(dataset, options)
        return live if live is not None else super().experimental_distribute_dataset(dataset, options)

    distribute_dataset = experimental_distribute_dataset

    def distribute_datasets_from_function(self, dataset_fn: Callable[[InputContext], Iterable[Any]],
                                          options: InputOptions | None = None) -> DatasetFromFunction:
        """One input pipeline per worker (``InputContext``); refused under fault tolerance."""
        extended = self.extended
        assert isinstance(extended, MultiWorkerMirroredExtended)
        if extended.fault_tolerance is not None:
            raise FaultToleranceError(
                "distribute_datasets_from_function under FaultTolerance: each pipeline is one worker's share, "
                "which nobody reads while that worker is gone. Give the global batches to "
                "experimental_distribute_dataset instead: each step cuts them over its live workers.")
        return super().distribute_datasets_from_function(dataset_fn, options)

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    @property
    def cluster_resolver(self) -> ClusterResolver:
        return self._cluster_resolver
