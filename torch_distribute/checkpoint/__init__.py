"""Checkpoints in the ``tf.train.Checkpoint`` model, stored as plain PyTorch state dicts.

A ``Checkpoint`` groups named objects (modules, optimizers, LR schedulers, metrics, nested
checkpoints, tensors) and saves their ``state_dict()`` in one file. Files hold one logical
copy of every object, all tensors on the CPU, so a checkpoint written by any number of
replicas or workers loads into any other number, or with no strategy at all. Files are
written atomically (temporary file, ``fsync``, rename) and loaded with
``torch.load(weights_only=True)``, which never runs pickled code.

The package holds ``file_io`` (atomic writes, safe loading), ``index`` (the ``checkpoint``
index file, ``latest_checkpoint``), ``object_graph`` (``Checkpoint``) and ``manager``
(``CheckpointManager``).

>>> import tempfile, os, torch, torch_distribute as td
>>> model = torch.nn.Linear(2, 1)
>>> step = torch.zeros((), dtype=torch.int64)
>>> ckpt = td.Checkpoint(model=model, step=step)
>>> directory = tempfile.mkdtemp()
>>> path = ckpt.save(os.path.join(directory, "ckpt"))
>>> os.path.basename(path), td.latest_checkpoint(directory) == path
('ckpt-1', True)
>>> ckpt.restore(path).assert_consumed()  # doctest: +ELLIPSIS
<torch_distribute.checkpoint...CheckpointLoadStatus object at ...>
"""

from torch_distribute.checkpoint.file_io import FORMAT as FORMAT
from torch_distribute.checkpoint.file_io import VERSION as VERSION
from torch_distribute.checkpoint.file_io import CorruptCheckpointError
from torch_distribute.checkpoint.index import INDEX_FILENAME as INDEX_FILENAME
from torch_distribute.checkpoint.index import latest_checkpoint
from torch_distribute.checkpoint.manager import CheckpointManager
from torch_distribute.checkpoint.object_graph import Checkpoint, CheckpointLoadStatus
from torch_distribute.checkpoint.object_graph import owning_strategy as owning_strategy

__all__ = [
    "Checkpoint",
    "CheckpointLoadStatus",
    "CheckpointManager",
    "CorruptCheckpointError",
    "latest_checkpoint",
]
