"""The cross-worker half of ``StrategyExtended`` for strategies with one process per worker.

``MultiWorkerMirroredStrategy`` and ``FullyShardedStrategy`` both keep a ``WorkerGroup`` and
answer the contract's topology and cross-worker calls the same way: through the group when
there are several workers, locally when there is one. A strategy mixes this in before its
``StrategyExtended`` base and sets ``_num_workers``, ``_worker_index``, ``_is_chief`` and
``_group`` (a ``WorkerGroup``, or None for a single worker).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from torch_distribute.cluster import ClusterResolver, ProcessGroupClusterResolver, resolve_cluster
from torch_distribute.collectives.worker_group import WorkerGroup
from torch_distribute.errors import ClusterConfigError

_DATA_AGREEMENT = "input agreement (does any worker still have data?)"


class AcrossWorkers:
    """Topology and cross-worker collectives over ``self._group`` (see the module docstring)."""

    _num_workers: int
    _worker_index: int
    _is_chief: bool
    _group: WorkerGroup | None

    @property
    def num_workers_in_sync(self) -> int:
        return self._num_workers

    @property
    def worker_index(self) -> int:
        return self._worker_index

    @property
    def is_chief(self) -> bool:
        return self._is_chief

    def _peers(self) -> WorkerGroup | None:
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


def peer_addresses(resolver: ClusterResolver) -> list[str]:
    """Each worker's address in worker-index order (chief first), where the cluster lists
    real ones: what the "waiting for workers" line names."""
    spec = resolver.cluster_spec()
    return [spec.task_address(job, index) for job in ("chief", "worker") if job in spec.jobs
            for index in spec.task_indices(job)]
