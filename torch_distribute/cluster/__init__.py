"""Cluster resolvers (``td.cluster_resolver``): how a worker finds its cluster and its place.

>>> from torch_distribute.cluster import resolve_cluster
>>> resolver = resolve_cluster({})          # nothing in the environment: one local worker
>>> resolver.num_workers, resolver.worker_index, resolver.is_chief
(1, 0, True)

The base class and TensorFlow's validation are in :mod:`torch_distribute.cluster.base`;
every ``host:port`` address is checked in one place, ``split_address``;
one module per source of a cluster description: :mod:`~torch_distribute.cluster.tf_config`,
:mod:`~torch_distribute.cluster.torchrun`, :mod:`~torch_distribute.cluster.slurm_resolver`,
:mod:`~torch_distribute.cluster.slurm_batch`, :mod:`~torch_distribute.cluster.kubeflow`,
:mod:`~torch_distribute.cluster.mpi`, :mod:`~torch_distribute.cluster.simple`; :mod:`~torch_distribute.cluster.detect` picks one.
"""

from torch_distribute.cluster.base import (
    VALID_TASK_TYPES,
    ClusterResolver,
    ConfigFields,
    validate_cluster_spec,
)
from torch_distribute.cluster.cluster_spec import ClusterSpec, field_path, split_address
from torch_distribute.cluster.detect import resolve_cluster
from torch_distribute.cluster.kubeflow import KubeflowClusterResolver
from torch_distribute.cluster.mpi import MPIClusterResolver
from torch_distribute.cluster.process_group import ProcessGroupClusterResolver
from torch_distribute.cluster.simple import SimpleClusterResolver
from torch_distribute.cluster.slurm import expand_hostlist, expand_tasks_per_node
from torch_distribute.cluster.slurm_batch import SlurmBatchClusterResolver
from torch_distribute.cluster.slurm_resolver import SlurmClusterResolver
from torch_distribute.cluster.tf_config import TFConfigClusterResolver
from torch_distribute.cluster.torchrun import TorchrunClusterResolver
from torch_distribute.errors import ClusterConfigError

__all__ = [
    "VALID_TASK_TYPES",
    "ClusterConfigError",
    "ClusterResolver",
    "ClusterSpec",
    "ConfigFields",
    "KubeflowClusterResolver",
    "MPIClusterResolver",
    "ProcessGroupClusterResolver",
    "SimpleClusterResolver",
    "SlurmBatchClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TorchrunClusterResolver",
    "expand_hostlist",
    "expand_tasks_per_node",
    "field_path",
    "resolve_cluster",
    "split_address",
    "validate_cluster_spec",
]
