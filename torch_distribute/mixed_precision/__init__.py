"""Mixed precision under any strategy: TensorFlow's names on ``torch.amp``.

``torch.autocast`` and ``torch.amp.GradScaler`` work inside ``strategy.run`` as PyTorch
documents them (the strategies sum the gradients before the scaler decides, see
``strategies/interception.py``). This package adds what porters from TensorFlow look for:
``LossScaleOptimizer``, and ``check_autocast`` to refuse a dtype a device cannot compute in.

>>> import torch, torch_distribute as td
>>> layer = torch.nn.Linear(2, 1)
>>> optimizer = td.mixed_precision.LossScaleOptimizer(torch.optim.SGD(layer.parameters(), lr=0.1))
>>> optimizer.loss_scale
32768.0
"""

from torch_distribute.mixed_precision.autocast_support import check_autocast
from torch_distribute.mixed_precision.loss_scale_optimizer import LossScaleOptimizer

__all__ = ["LossScaleOptimizer", "check_autocast"]
