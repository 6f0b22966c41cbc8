"""Strategies: one module per strategy, all on the ``Strategy`` base."""

from torch_distribute.strategies.base import Strategy, get_replica_context, get_strategy
from torch_distribute.strategies.central_storage import CentralStorageStrategy
from torch_distribute.strategies.extended import StrategyExtended
from torch_distribute.strategies.fully_sharded import FullyShardedStrategy, default_shard_policy
from torch_distribute.strategies.interception import owner_of
from torch_distribute.strategies.mesh import DeviceMesh, LayoutMap
from torch_distribute.strategies.mirrored import MirroredReplicaContext, MirroredStrategy
from torch_distribute.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy
from torch_distribute.strategies.parameter_server import ParameterServerStrategy
from torch_distribute.strategies.single_replica import OneDeviceStrategy

__all__ = [
    "get_replica_context",
    "get_strategy",
    "CentralStorageStrategy",
    "DeviceMesh",
    "FullyShardedStrategy",
    "LayoutMap",
    "MirroredReplicaContext",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "Strategy",
    "StrategyExtended",
    "default_shard_policy",
    "owner_of",
]
