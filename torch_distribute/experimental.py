"""``td.experimental``: TensorFlow's ``tf.distribute.experimental`` names kept for porting, and
per-step fault tolerance (``FaultTolerance``, on torchft) with its committed-step log.

TensorFlow's guides still write several strategies and options under ``experimental``
(``tf.distribute.experimental.CentralStorageStrategy()``,
``tf.distribute.experimental.CommunicationOptions(implementation=...)``,
``tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)``); here they are the
same objects as their stable names, so a mechanical port runs as it is.

>>> import torch_distribute as td
>>> td.experimental.PreemptionCheckpointHandler.__name__
'PreemptionCheckpointHandler'
>>> td.experimental.CentralStorageStrategy is td.CentralStorageStrategy
True
>>> td.experimental.coordinator.ClusterCoordinator is td.coordinator.ClusterCoordinator
True
>>> td.experimental.FaultTolerance.__name__
'FaultTolerance'
"""

from torch_distribute import coordinator, partitioners
from torch_distribute.collectives.communication import (
    CommunicationImplementation,
    CommunicationOptions,
)
from torch_distribute.fault_tolerance import PreemptionCheckpointHandler, TerminationConfig
from torch_distribute.input import ValueContext
from torch_distribute.strategies import (
    CentralStorageStrategy,
    MultiWorkerMirroredStrategy,
    ParameterServerStrategy,
)
from torch_distribute.strategies.committed_steps import read_committed_steps
from torch_distribute.strategies.fault_tolerant import FaultTolerance

CollectiveCommunication = CommunicationImplementation  # TensorFlow's older name of the same enum

__all__ = [
    "CentralStorageStrategy",
    "CollectiveCommunication",
    "CommunicationImplementation",
    "CommunicationOptions",
    "FaultTolerance",
    "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy",
    "PreemptionCheckpointHandler",
    "TerminationConfig",
    "ValueContext",
    "coordinator",
    "partitioners",
    "read_committed_steps",
]
