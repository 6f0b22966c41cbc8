"""Cluster resolvers (``td.cluster_resolver``): how a worker finds its cluster and its place.

>>> from torch_distribute.cluster import resolve_cluster
>>> resolver = resolve_cluster({})          # nothing in the environment: one local worker
>>> resolver.num_workers, resolver.worker_index, resolver.is_chief
(1, 0, True)

See :mod:`torch_distribute.cluster.resolvers` for ``TF_CONFIG``, torchrun and SLURM.
"""

from torch_distribute.cluster.cluster_spec import ClusterSpec, split_address
from torch_distribute.cluster.resolvers import (
    VALID_TASK_TYPES,
    ClusterResolver,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    resolve_cluster,
    validate_cluster_spec,
)
from torch_distribute.cluster.slurm import expand_hostlist, expand_tasks_per_node
from torch_distribute.errors import ClusterConfigError

__all__ = [
    "VALID_TASK_TYPES",
    "ClusterConfigError",
    "ClusterResolver",
    "ClusterSpec",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TorchrunClusterResolver",
    "expand_hostlist",
    "expand_tasks_per_node",
    "resolve_cluster",
    "split_address",
    "validate_cluster_spec",
]
