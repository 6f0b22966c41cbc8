"""``ProcessGroupClusterResolver``: the cluster of a ``torch.distributed`` group made elsewhere.

Ray Train, ``accelerate`` (``Accelerator()``), Lightning and a user's own
``init_process_group`` create the default process group before the strategy exists. The
strategy then takes that group's world size and rank (``from_initialized``) instead of
reading the environment again. It is never detected by ``resolve_cluster``: the strategies
build it when ``torch.distributed.is_initialized()``.

>>> r = ProcessGroupClusterResolver(world_size=2, rank=1, environ={"MASTER_ADDR": "10.0.0.5"})
>>> r.num_workers, r.worker_index, r.is_chief, r.rendezvous_address()
(2, 1, False, ('10.0.0.5', 0))
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

from torch_distribute.cluster.base import ClusterResolver, ConfigFields
from torch_distribute.cluster.cluster_spec import ClusterSpec

__all__ = ["ProcessGroupClusterResolver"]


class ProcessGroupClusterResolver(ClusterResolver):
    """Worker ``rank`` of ``world_size``: the place an existing process group gives.

    ``rendezvous_address()`` is where the chief (rank 0) offers the strategy's own store:
    ``MASTER_ADDR`` where set (Ray Train, torchrun and accelerate set it to rank 0's host),
    else this machine's name, with port 0 (any free port; the chief sends the others the
    one it got over the group).
    """

    def __init__(self, world_size: int, rank: int, *, environ: Mapping[str, str] | None = None) -> None:
        super().__init__(environ=environ)
        self._world_size = world_size
        self._rank = rank

    @classmethod
    def from_initialized(cls, environ: Mapping[str, str] | None = None) -> ProcessGroupClusterResolver:
        """The default group's world size and this process's rank in it."""
        import torch.distributed as dist

        return cls(dist.get_world_size(), dist.get_rank(), environ=environ)

    def cluster_spec(self) -> ClusterSpec:
        if self._world_size == 1:
            return ClusterSpec({})
        return ClusterSpec({"worker": [f"rank{i}" for i in range(self._world_size)]})

    def config_fields(self) -> ConfigFields:
        """The group's rank is this task's index; the cluster has no addresses."""
        return ConfigFields(cluster="the process group", task_type="task_type",
                            task_id="the process group's rank", check_addresses=False)

    def _default_task_type(self) -> str | None:
        return "worker"

    def _default_task_id(self) -> int | None:
        return self._rank

    def rendezvous_address(self) -> tuple[str, int]:
        host = self.environ.get("MASTER_ADDR", "").strip() or socket.getfqdn()
        return host, 0
