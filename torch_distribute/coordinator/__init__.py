"""``td.coordinator``: TensorFlow's ``tf.distribute.coordinator`` for ParameterServerStrategy.

>>> import torch_distribute as td
>>> td.coordinator.experimental_get_current_worker_index() is None   # not in a scheduled fn
True
"""

from torch_distribute.coordinator.cluster_coordinator import ClusterCoordinator
from torch_distribute.coordinator.dispatcher import RemoteError
from torch_distribute.coordinator.per_worker import (
    PerWorkerDataset,
    PerWorkerIterator,
    PerWorkerValues,
)
from torch_distribute.coordinator.remote_value import RemoteValue, RemoteValueStatus
from torch_distribute.ps.worker import current_worker_index as experimental_get_current_worker_index

__all__ = [
    "ClusterCoordinator",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "PerWorkerValues",
    "RemoteError",
    "RemoteValue",
    "RemoteValueStatus",
    "experimental_get_current_worker_index",
]
