"""torch-distribute: the ``tf.distribute`` programming model for PyTorch custom training loops.

>>> import torch, torch_distribute as td
>>> strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
>>> with strategy.scope():
...     model = torch.nn.Linear(4, 1)
...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
>>> def step(x, y):
...     loss = td.compute_average_loss((model(x) - y).pow(2).squeeze(1), global_batch_size=8)
...     loss.backward()
...     optimizer.step()
...     optimizer.zero_grad()
...     return loss
>>> batch = (torch.ones(8, 4), torch.zeros(8, 1))
>>> for x, y in strategy.experimental_distribute_dataset([batch]):
...     loss = strategy.reduce("sum", strategy.run(step, args=(x, y)), axis=None)
"""

from torch_distribute import cluster as cluster_resolver
from torch_distribute import (
    config,
    coordinator,
    estimator,
    experimental,
    keras,
    keras3,
    metrics,
    mixed_precision,
    partitioners,
)
from torch_distribute.checkpoint import Checkpoint, CheckpointManager, latest_checkpoint
from torch_distribute.collectives import (
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)
from torch_distribute.collectives.communication import (
    CommunicationImplementation,
    CommunicationOptions,
)
from torch_distribute.compiled_function import Function, function
from torch_distribute.context import has_strategy, in_cross_replica_context
from torch_distribute.errors import (
    CheckpointError,
    ClosureCancelledError,
    ClusterConfigError,
    ContextError,
    DatasetError,
    DistributeError,
    FaultToleranceError,
    InputSignatureError,
    InvalidArgumentError,
    InvalidAxisError,
    InvalidDeviceError,
    InvalidReduceOpError,
    JobAuthenticationError,
    KerasBackendError,
    KerasIntegrationError,
    KerasUnsupportedError,
    LayoutError,
    LossScalingError,
    NonFiniteError,
    NotEnoughWorkersError,
    OutOfRangeError,
    ParameterServerUnavailableError,
    PeerProgramError,
    ReplicaMismatchError,
    UnmirroredStateError,
    UnsupportedDtypeError,
    WorkerUnavailableError,
)
from torch_distribute.fault_tolerance import BackupAndRestore
from torch_distribute.input import (
    AutoShardPolicy,
    InputContext,
    InputOptions,
    InputReplicationMode,
    TensorSpec,
    ValueContext,
    data,
)
from torch_distribute.losses import compute_average_loss, scale_regularization_loss
from torch_distribute.ps import distribute_server
from torch_distribute.reduce_op import ReduceOp
from torch_distribute.replica_context import ReplicaContext
from torch_distribute.strategies import (
    CentralStorageStrategy,
    DeviceMesh,
    FullyShardedStrategy,
    LayoutMap,
    MirroredStrategy,
    MultiWorkerMirroredStrategy,
    OneDeviceStrategy,
    ParameterServerStrategy,
    Strategy,
    StrategyExtended,
    get_replica_context,
    get_strategy,
)
from torch_distribute.values import DistributedValues, Mirrored, PerReplica

__version__ = "0.1.0"

__all__ = [
    "AutoShardPolicy",
    "BackupAndRestore",
    "CentralStorageStrategy",
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "ClosureCancelledError",
    "ClusterConfigError",
    "CommunicationImplementation",
    "CommunicationOptions",
    "ContextError",
    "CrossDeviceOps",
    "DatasetError",
    "DeviceMesh",
    "DistributeError",
    "DistributedValues",
    "FaultToleranceError",
    "FullyShardedStrategy",
    "Function",
    "HierarchicalCopyAllReduce",
    "InputContext",
    "InputOptions",
    "InputSignatureError",
    "InputReplicationMode",
    "InvalidArgumentError",
    "InvalidAxisError",
    "InvalidDeviceError",
    "InvalidReduceOpError",
    "JobAuthenticationError",
    "LayoutError",
    "LayoutMap",
    "KerasBackendError",
    "KerasIntegrationError",
    "KerasUnsupportedError",
    "LossScalingError",
    "NonFiniteError",
    "NotEnoughWorkersError",
    "Mirrored",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OutOfRangeError",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "ParameterServerUnavailableError",
    "PerReplica",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "PeerProgramError",
    "ReplicaMismatchError",
    "Strategy",
    "StrategyExtended",
    "TensorSpec",
    "UnmirroredStateError",
    "UnsupportedDtypeError",
    "ValueContext",
    "WorkerUnavailableError",
    "cluster_resolver",
    "config",
    "data",
    "estimator",
    "experimental",
    "compute_average_loss",
    "function",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "keras",
    "keras3",
    "latest_checkpoint",
    "metrics",
    "mixed_precision",
    "coordinator",
    "distribute_server",
    "partitioners",
    "scale_regularization_loss",
]
