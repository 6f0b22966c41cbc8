"""``td.experimental``: TensorFlow's ``tf.distribute.experimental`` names kept for porting.

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

CollectiveCommunication = CommunicationImplementation  # TensorFlow's older name of the same enum

__all__ = [
    "CentralStorageStrategy",
    "CollectiveCommunication",
    "CommunicationImplementation",
    "CommunicationOptions",
    "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy",
    "PreemptionCheckpointHandler",
    "TerminationConfig",
    "ValueContext",
    "coordinator",
    "partitioners",
]
