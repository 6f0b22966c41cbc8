"""Collectives, every one of them, at three levels.

- In process (several replicas of one process): ``cross_device_ops`` (TensorFlow's
  ``ReductionToOneDevice``, ``HierarchicalCopyAllReduce``, ``NcclAllReduce``).
- Between worker processes: ``worker_group.WorkerGroup`` over ``torch.distributed``, with a
  deadline on every call and the missing worker named when one fails.
- Between replicas, differentiable: ``differentiable.all_reduce``/``all_gather``, which a
  ``ReplicaContext`` runs through its strategy's ``merge_call``.

Shared by all: ``packing`` (many tensors in few flat buffers) and ``arithmetic.divide`` (the
one MEAN division).
"""

from torch_distribute.collectives.cross_device_ops import (
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
    select_cross_device_ops,
)

__all__ = [
    "CrossDeviceOps",
    "HierarchicalCopyAllReduce",
    "NcclAllReduce",
    "ReductionToOneDevice",
    "select_cross_device_ops",
]
