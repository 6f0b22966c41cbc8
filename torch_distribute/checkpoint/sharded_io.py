"""Sharded checkpoints: a directory into which every worker writes its own shards.

Under a strategy whose state is sharded (``extended.checkpoint_is_sharded``, e.g.
``FullyShardedStrategy``), nothing gathers the whole model on one process: the tensors go
through ``torch.distributed.checkpoint`` (DCP), each worker writing its shards, and the chief
adds ``layout.pt``, the checkpoint's payload with every tensor replaced by its DCP key. The
directory is written under a temporary name and renamed when complete.

A sharded checkpoint holds the same logical payload as a plain file (whole shapes, the same
keys), so it loads anywhere: into sharded objects (each worker reads only its shard), into
any other strategy or none (whole tensors), and ``convert_to_file`` turns it into one plain
file (``torch-distribute checkpoint convert``).

>>> import os, tempfile, torch
>>> path = os.path.join(tempfile.mkdtemp(), "ckpt-1")
>>> payload = {"format": "f", "objects": {"w": torch.ones(2), "n": 3}}
>>> write_sharded(path, payload, is_writer=True, barrier=lambda what: None)
>>> sorted(os.listdir(path)), read_sharded(path, {})["objects"]["w"]
(['.metadata', '__0_0.distcp', 'layout.pt'], tensor([1., 1.]))
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from torch_distribute.checkpoint.file_io import (
    LAYOUT_FILENAME,
    atomic_write,
    check_payload,
    directory_of,
    is_sharded_checkpoint,
)
from torch_distribute.errors import CheckpointError

__all__ = ["convert_to_file", "read_sharded", "split_tensors", "write_sharded"]

_TENSOR_MARK = "__td_tensor__"


def split_tensors(payload: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(the payload with each tensor replaced by a marker, ``{key: tensor}``).

    A key is the JSON list of the dict keys and list positions leading to the tensor, so
    module names with dots and optimizer indices stay unambiguous.
    """
    tensors: dict[str, torch.Tensor] = {}

    def visit(value: Any, trail: list[Any]) -> Any:
        if isinstance(value, torch.Tensor):
            key = json.dumps(trail)
            tensors[key] = value
            return {_TENSOR_MARK: key}
        if isinstance(value, dict):
            out: dict[Any, Any] = OrderedDict() if isinstance(value, OrderedDict) else {}
            for k, item in value.items():
                out[k] = visit(item, [*trail, k])
            metadata = getattr(value, "_metadata", None)  # nn.Module state-dict versions
            if metadata is not None and isinstance(out, OrderedDict):
                out._metadata = metadata  # type: ignore[attr-defined]
            return out
        if isinstance(value, (list, tuple)):
            items = [visit(item, [*trail, k]) for k, item in enumerate(value)]
            if isinstance(value, list):
                return items
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        return value

    return visit(payload, []), tensors


def _join(layout: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(layout, dict):
        if set(layout) == {_TENSOR_MARK}:
            return tensors[layout[_TENSOR_MARK]]
        for k, item in layout.items():
            layout[k] = _join(item, tensors)
        return layout
    if isinstance(layout, list):
        return [_join(item, tensors) for item in layout]
    if isinstance(layout, tuple):
        items = [_join(item, tensors) for item in layout]
        return type(layout)(*items) if hasattr(layout, "_fields") else type(layout)(items)
    return layout


def write_sharded(path: str, payload: Any, is_writer: bool, barrier: Callable[[str], Any]) -> None:
    """Write ``payload`` as the sharded checkpoint directory ``path``; every worker calls it.

    ``is_writer``: this worker writes the layout and renames the directory (the chief).
    ``barrier(what)``: returns once every worker has called it (a collective).
    """
    directory = directory_of(path)
    partial = os.path.join(directory, f".{os.path.basename(path)}.partial")
    if is_writer:
        shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save
        os.makedirs(partial)
    barrier("start of a sharded checkpoint write")
    layout, tensors = split_tensors(payload)
    with _quiet_single_process():
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(partial), no_dist=not dist.is_initialized())
    if is_writer:
        atomic_write(os.path.join(partial, LAYOUT_FILENAME), lambda f: torch.save(layout, f))
        _replace_directory(partial, path)
    barrier("end of a sharded checkpoint write")


def _replace_directory(source: str, target: str) -> None:
    """Rename ``source`` to ``target``; an older ``target`` is removed only after."""
    old = None
    if os.path.lexists(target):
        old = f"{target}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
    os.replace(source, target)
    if old is not None:
        with contextlib.suppress(OSError):
            if os.path.isdir(old):
                shutil.rmtree(old)
            else:
                os.remove(old)


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def read_sharded(path: str, targets: dict[str, torch.Tensor]) -> Any:
    """The payload of the sharded checkpoint ``path``, read by this process alone.

    ``targets``: ``{key: tensor}`` (from ``split_tensors`` of the objects' current states);
    where one is a DTensor of the saved shape, only this worker's shard is read into a
    DTensor like it. Every other tensor is read whole, on the CPU.
    """
    layout = torch.load(os.path.join(path, LAYOUT_FILENAME), map_location="cpu", weights_only=True)
    reader = dcp.FileSystemReader(path)
    metadata = reader.read_metadata()
    flat: dict[str, torch.Tensor] = {}
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        target = targets.get(key)
        dtype = item.properties.dtype
        if isinstance(target, DTensor) and tuple(target.shape) == tuple(item.size):
            flat[key] = torch.empty_like(target, dtype=dtype)
        else:
            flat[key] = torch.empty(tuple(item.size), dtype=dtype)
    with _quiet_single_process():
        # Each process reads what it needs on its own: no collective, so no worker waits
        # for another (or hangs when only some restore).
        dcp.load(flat, storage_reader=reader, no_dist=True)
    return _join(layout, flat)


def convert_to_file(source: str, target: str) -> None:
    """Write the sharded checkpoint directory ``source`` as one plain checkpoint file ``target``
    (what ``torch-distribute checkpoint convert SOURCE TARGET`` runs; one process, no group).

    >>> import os, tempfile, torch, torch_distribute as td
    >>> directory = tempfile.mkdtemp()
    >>> sharded = os.path.join(directory, "ckpt-1")
    >>> write_sharded(sharded, {"format": td.checkpoint.FORMAT, "version": 1, "save_counter": 1,
    ...                         "objects": {"w": torch.ones(2)}}, is_writer=True, barrier=lambda what: None)
    >>> convert_to_file(sharded, os.path.join(directory, "plain.pt"))
    >>> td.Checkpoint(w=torch.zeros(2)).read(os.path.join(directory, "plain.pt")).assert_consumed() is not None
    True
    """
    if not is_sharded_checkpoint(source):
        raise CheckpointError(
            f"{source!r} is not a sharded checkpoint directory (it needs {LAYOUT_FILENAME} and "
            "torch.distributed.checkpoint's .metadata); give a directory written under "
            "FullyShardedStrategy."
        )
    payload = check_payload(source, read_sharded(source, {}))
    atomic_write(target, lambda f: torch.save(payload, f))
