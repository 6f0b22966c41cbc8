"""``td.experimental``: TensorFlow's ``tf.distribute.experimental`` names kept for porting.

>>> import torch_distribute as td
>>> td.experimental.PreemptionCheckpointHandler.__name__
'PreemptionCheckpointHandler'
"""

from torch_distribute.fault_tolerance import PreemptionCheckpointHandler, TerminationConfig

__all__ = ["PreemptionCheckpointHandler", "TerminationConfig"]
