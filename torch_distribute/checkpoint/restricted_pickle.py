"""Reading ``torch.distributed.checkpoint``'s ``.metadata`` without running anything in it.

DCP writes a sharded checkpoint's index of shards (``.metadata``) with ``pickle.dump`` and its
own reader loads it with ``pickle.load``, which calls whatever the file names: a directory
anyone could write (a shared filesystem, a download) would run code in every process that
opens it. ``load_metadata`` reads it with an unpickler that resolves only the globals DCP's
metadata is made of (its dataclasses, ``torch.Size``, dtypes, layouts, paths), each by exact
``(module, name)``; a file that names anything else raises ``CheckpointError`` naming the
file, before anything it names is called. Plain files and ``layout.pt`` load with
``torch.load(weights_only=True)``, torch's own allowlist.

>>> import io, pickle, subprocess
>>> try:
...     load_metadata(io.BytesIO(pickle.dumps(subprocess.run)), "ckpt-1/.metadata")
... except Exception as error:
...     print(type(error).__name__, str(error).split(",")[0])
CheckpointError Checkpoint file 'ckpt-1/.metadata' names subprocess.run
"""

from __future__ import annotations

import pickle
from typing import IO, Any

import torch

from torch_distribute.checkpoint.file_io import CorruptCheckpointError
from torch_distribute.errors import CheckpointError

__all__ = ["ALLOWED_GLOBALS", "load_metadata"]

_DCP_METADATA_CLASSES = (
    "BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex", "StorageMeta",
    "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING",
)

#: ``(module, name)`` pairs a ``.metadata`` file may name: DCP's metadata dataclasses (rebuilt
#: field by field, none with code beyond setting its fields), ``torch.Size``, torch's layout
#: lookup by name, and paths (``StorageMeta.checkpoint_id``). Dtypes are allowed separately:
#: any attribute of ``torch`` that is a ``torch.dtype``.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {("torch.distributed.checkpoint.metadata", name) for name in _DCP_METADATA_CLASSES}
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], name: str):
        super().__init__(file)
        self._name = name

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"Checkpoint file {self._name!r} names {module}.{name}, which is not part of "
            "torch.distributed.checkpoint's metadata: the file was not written by "
            "torch-distribute (or was tampered with) and is refused unread; nothing in it ran. "
            "Restore the checkpoint from a copy you trust."
        )


def load_metadata(file: IO[bytes], name: str) -> Any:
    """The object pickled in ``file`` (DCP's ``Metadata``), resolving only ``ALLOWED_GLOBALS``.

    ``name`` is the file's path, for the error. Raises ``CheckpointError`` naming it for a
    global outside the allowlist, ``CorruptCheckpointError`` (a ``CheckpointError``) for
    bytes that are no such pickle.
    """
    try:
        return _MetadataUnpickler(file, name).load()
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - any unpickling failure is a damaged file
        raise CorruptCheckpointError(
            f"Checkpoint file {name!r} could not be read as torch.distributed.checkpoint metadata "
            f"({type(error).__name__}: {error}); the file is damaged. Restore an earlier checkpoint."
        ) from error
