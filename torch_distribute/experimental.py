"""``td.experimental``: TensorFlow's ``tf.distribute.experimental`` names kept for porting, and
per-step fault tolerance (``FaultTolerance``, on torchft) with its committed-step log.

>>> import torch_distribute as td
>>> td.experimental.PreemptionCheckpointHandler.__name__, td.experimental.FaultTolerance.__name__
('PreemptionCheckpointHandler', 'FaultTolerance')
"""

from torch_distribute.fault_tolerance import PreemptionCheckpointHandler, TerminationConfig
from torch_distribute.strategies.committed_steps import read_committed_steps
from torch_distribute.strategies.fault_tolerant import FaultTolerance

__all__ = ["FaultTolerance", "PreemptionCheckpointHandler", "TerminationConfig", "read_committed_steps"]
