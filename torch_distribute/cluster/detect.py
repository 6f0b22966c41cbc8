"""``resolve_cluster()``: pick the resolver for the environment this process runs in.

The resolvers in ``RESOLVERS`` are asked in order whether their environment applies
(``is_present``); the first that says yes is built. With none, the process is a single
local worker (``SimpleClusterResolver`` with an empty cluster).

>>> r = resolve_cluster({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
>>> type(r).__name__, r.worker_index
('TorchrunClusterResolver', 1)
"""

from __future__ import annotations

from collections.abc import Mapping

from torch_distribute.cluster.base import ClusterResolver
from torch_distribute.cluster.cluster_spec import ClusterSpec
from torch_distribute.cluster.env import environ_or_default
from torch_distribute.cluster.simple import SimpleClusterResolver
from torch_distribute.cluster.slurm_resolver import SlurmClusterResolver
from torch_distribute.cluster.tf_config import TFConfigClusterResolver
from torch_distribute.cluster.torchrun import TorchrunClusterResolver

__all__ = ["RESOLVERS", "resolve_cluster"]

#: The resolvers ``resolve_cluster()`` tries, in order: an explicit ``TF_CONFIG`` wins over
#: torchrun's variables, which win over a SLURM step (``srun torchrun ...`` sets both).
RESOLVERS: tuple[type[ClusterResolver], ...] = (
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    SlurmClusterResolver,
)


def resolve_cluster(environ: Mapping[str, str] | None = None) -> ClusterResolver:
    """The resolver for the environment this process runs in.

    In order: ``TF_CONFIG`` (when set with a non-empty ``cluster``), torchrun's variables
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``), a SLURM step (``SLURM_PROCID`` and a node
    list); otherwise ``SimpleClusterResolver(ClusterSpec({}))``: a single local worker.

    Raises:
        ClusterConfigError: the chosen source is malformed (e.g. ``TF_CONFIG`` is not JSON);
            a broken description is never silently skipped.

    >>> r = resolve_cluster({})
    >>> type(r).__name__, r.num_workers, r.worker_index, r.is_chief
    ('SimpleClusterResolver', 1, 0, True)
    """
    env = environ_or_default(environ)
    for resolver in RESOLVERS:
        if resolver.is_present(env):
            return resolver(environ=env)
    return SimpleClusterResolver(ClusterSpec({}), environ=env)
