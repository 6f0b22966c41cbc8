"""Sharded checkpoints: a directory into which every worker writes its own shards.

Under a strategy whose state is sharded (``extended.checkpoint_is_sharded``, e.g.
``FullyShardedStrategy``), nothing gathers the whole model on one process: the tensors go
through ``torch.distributed.checkpoint`` (DCP), each worker writing its shards, and the chief
adds ``layout.pt``, the checkpoint's payload with every tensor replaced by its DCP key, and
the size and SHA-256 of every file (each worker hashes the shards it wrote; the chief gathers
them). The directory is written under a temporary name and renamed when complete. Reading
checks ``layout.pt``'s own checksum, then each file against its recorded one before reading
it (a worker reading only its shard checks only the files it reads).

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
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from torch_distribute.checkpoint.file_io import (
    DCP_METADATA,
    LAYOUT_FILENAME,
    CorruptCheckpointError,
    check_file,
    check_payload,
    directory_of,
    file_fingerprint,
    is_sharded_checkpoint,
    load_weights_only,
    remove_stale_temporaries,
    save_file,
    temporary_directory_name,
)
from torch_distribute.checkpoint.restricted_pickle import load_metadata
from torch_distribute.errors import CheckpointError

__all__ = ["CHECKSUMS_KEY", "check_sharded", "convert_to_file", "read_sharded", "split_tensors", "write_sharded"]

#: In ``layout.pt``: ``{file name: [size, sha256]}`` of every shard file and ``.metadata``
#: (each worker hashes the files it wrote; the chief gathers them).
CHECKSUMS_KEY = "__td_checksums__"

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


def write_sharded(
    path: str,
    payload: Any,
    is_writer: bool,
    barrier: Callable[[str], Any],
    gather: Callable[[Any, str], list[Any]] | None = None,
    finish: Callable[[], None] | None = None,
) -> None:
    """Write ``payload`` as the sharded checkpoint directory ``path``; every worker calls it.

    ``is_writer``: this worker writes the layout and renames the directory (the chief).
    ``barrier(what)``: returns once every worker has called it (a collective).
    ``gather(value, what)``: the values of every worker, in worker order (a collective,
    e.g. ``strategy.extended.all_gather_objects``); used instead of ``barrier`` when given,
    so that each worker's shard checksums reach the chief and the chief's errors reach
    every worker. Without it (one process) the checksums are this process's own.
    ``finish()``: run by the writer once the directory is complete, before the others
    return (the ``checkpoint`` index); its errors are raised on every worker.

    Every worker raises ``CheckpointError`` if the chief cannot create, finish or rename
    the directory, or if the workers asked for different paths.
    """
    def exchange(value: Any, what: str) -> list[Any]:
        if gather is not None:
            return gather(value, what)
        barrier(what)
        return [value]

    error = None
    partial = temporary_directory_name(path)
    if is_writer:
        try:
            remove_stale_temporaries(directory_of(path))
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    start = exchange({"path": os.path.abspath(path), "partial": partial if is_writer else None, "error": error},
                     "start of a sharded checkpoint write")
    _raise_failures(path, start)
    paths = {entry["path"] for entry in start}
    if len(paths) > 1:
        raise CheckpointError(
            f"Workers asked to write the sharded checkpoint to different paths ({sorted(paths)}); "
            "every worker writes its shards into one directory: pass the same path everywhere."
        )
    partial = next((entry["partial"] for entry in start if entry["partial"]), partial)
    layout, tensors = split_tensors(payload)
    writer = _RecordingWriter(partial)
    with _quiet_single_process():
        dcp.save(tensors, storage_writer=writer, no_dist=not dist.is_initialized())
    mine: dict[str, Any] = {"files": {}, "error": None}
    try:
        mine["files"] = {name: list(file_fingerprint(os.path.join(partial, name))) for name in writer.written}
    except OSError as exc:
        mine["error"] = f"{type(exc).__name__}: {exc}"
    every = exchange(mine, "checksums of a sharded checkpoint's shards")
    _raise_failures(path, every)
    error = None
    if is_writer:
        try:
            checksums: dict[str, list[Any]] = {}
            for entry in every:
                checksums.update(entry["files"])
            checksums[DCP_METADATA] = list(file_fingerprint(os.path.join(partial, DCP_METADATA)))
            layout[CHECKSUMS_KEY] = checksums
            save_file(os.path.join(partial, LAYOUT_FILENAME), layout)
            _replace_directory(partial, path)
            if finish is not None:
                finish()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    _raise_failures(path, exchange({"error": error}, "end of a sharded checkpoint write"))


def _raise_failures(path: str, outcomes: list[dict[str, Any]]) -> None:
    failed = [(worker, entry["error"]) for worker, entry in enumerate(outcomes) if entry["error"]]
    if failed:
        worker, message = failed[0]
        raise CheckpointError(
            f"Could not write the sharded checkpoint {path!r}: worker {worker} failed: {message}. "
            "Any previous checkpoint there is unchanged; check the disk space and permissions."
        )


class _RecordingWriter(dcp.FileSystemWriter):
    """DCP's file writer, recording the files this worker wrote (to hash them)."""

    def __init__(self, path: str):
        super().__init__(path)
        self.written: list[str] = []

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        for result in future.wait():
            name = result.storage_data.relative_path
            if name not in self.written:
                self.written.append(name)
        return future


class _VerifyingReader(dcp.FileSystemReader):
    """DCP's file reader, checking each file it is about to read against its checksum, and
    reading ``.metadata`` with an allowlist (DCP's own reader unpickles whatever it names).

    The metadata is read once, after its checksum is checked; DCP's later ``read_metadata``
    calls get that same object, so the file is never unpickled unchecked.
    """

    def __init__(self, path: str, checksums: dict[str, Any] | None):
        super().__init__(path)
        self.directory = path
        self.checksums = checksums
        self.verified: set[str] = set()
        self.failure: CheckpointError | None = None
        self._metadata: Any = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self._metadata is None:
            _verify_member(self.directory, DCP_METADATA, self.checksums, full=True)
            name = os.path.join(self.directory, DCP_METADATA)
            with open(name, "rb") as file:
                metadata = load_metadata(file, name)
            if not isinstance(metadata, Metadata):
                raise CheckpointError(
                    f"Checkpoint file {name!r} holds a {type(metadata).__name__}, not "
                    "torch.distributed.checkpoint metadata; restore the checkpoint from a copy you trust.")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._metadata = metadata
        return self._metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        names = {self.storage_data[item.storage_index].relative_path for item in plan.items}
        for name in sorted(names - self.verified):
            try:
                _verify_member(self.directory, name, self.checksums, full=True)
            except CheckpointError as exc:
                self.failure = exc
                raise
            self.verified.add(name)
        return super().read_data(plan, planner)


def _verify_member(directory: str, name: str, checksums: dict[str, Any] | None, full: bool) -> None:
    """Raise ``CorruptCheckpointError`` unless ``directory/name`` has its recorded size (and,
    ``full``, checksum); checkpoints written before checksums are not checked."""
    if checksums is None:
        return
    path = os.path.join(directory, name)
    expected = checksums.get(name)
    if not (isinstance(expected, (list, tuple)) and len(expected) == 2):
        raise CorruptCheckpointError(
            f"Sharded checkpoint {directory!r} is damaged: {name!r} has no checksum in its "
            f"{LAYOUT_FILENAME}. Restore an earlier checkpoint.")
    size, digest = expected
    if not os.path.isfile(path):
        raise CorruptCheckpointError(
            f"Sharded checkpoint {directory!r} is damaged: {name!r} is missing. Restore an earlier checkpoint.")
    actual = os.path.getsize(path)
    if actual != size:
        raise CorruptCheckpointError(
            f"Sharded checkpoint file {path!r} is damaged: truncated ({actual} of {size} bytes). "
            "Restore an earlier checkpoint.")
    if full and file_fingerprint(path)[1] != digest:
        raise CorruptCheckpointError(
            f"Sharded checkpoint file {path!r} is damaged: checksum mismatch: the file is damaged. "
            "Restore an earlier checkpoint.")


def _load_layout(path: str) -> tuple[Any, dict[str, Any] | None]:
    """(the layout of the sharded checkpoint ``path``, its shard checksums or ``None``)."""
    layout_path = os.path.join(path, LAYOUT_FILENAME)
    check_file(layout_path, full=True)
    layout = load_weights_only(layout_path, "It holds values other than tensors and plain Python values: it "
                                            "was not written by torch-distribute (or was tampered with); "
                                            "nothing in it ran.")
    checksums = layout.pop(CHECKSUMS_KEY, None) if isinstance(layout, dict) else None
    return layout, checksums


def check_sharded(path: str, full: bool = False) -> None:
    """Raise ``CorruptCheckpointError`` if the sharded checkpoint ``path`` is damaged.

    Checks ``layout.pt`` fully (it is small) and that every recorded file has its size;
    ``full=True`` also hashes every file.
    """
    missing = [name for name in (LAYOUT_FILENAME, DCP_METADATA) if not os.path.isfile(os.path.join(path, name))]
    if missing:
        raise CorruptCheckpointError(
            f"Sharded checkpoint {path!r} is incomplete: {' and '.join(missing)} missing (a save "
            "that did not finish, or files lost). Restore an earlier checkpoint.")
    try:
        _, checksums = _load_layout(path)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(
            f"Sharded checkpoint {path!r} is damaged: its {LAYOUT_FILENAME} could not be read "
            f"({type(exc).__name__}: {exc}). Restore an earlier checkpoint.") from exc
    if checksums is None:
        return
    for name in [DCP_METADATA, *sorted(n for n in checksums if n != DCP_METADATA)]:
        _verify_member(path, name, checksums, full=full)


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


def read_sharded(path: str, targets: dict[str, torch.Tensor],
                 templates: dict[tuple[Any, ...], torch.Tensor] | None = None) -> Any:
    """The payload of the sharded checkpoint ``path``, read by this process alone.

    ``targets``: ``{key: tensor}`` (from ``split_tensors`` of the objects' current states);
    where one is a DTensor of the saved shape, only this worker's shard is read into a
    DTensor like it. ``templates``: ``{path: DTensor}`` for states that do not exist yet (an
    optimizer's before its first step): a saved tensor under a path of the template's shape
    is read as a shard like it. Every other tensor is read whole, on the CPU.
    """
    layout, checksums = _load_layout(path)
    reader = _VerifyingReader(path, checksums)
    metadata = reader.read_metadata()  # checksum first, then an allowlist: nothing in it runs
    flat: dict[str, torch.Tensor] = {}
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        target = targets.get(key)
        if target is None and templates:
            target = _template_for(key, templates)
        dtype = item.properties.dtype
        if isinstance(target, DTensor) and tuple(target.shape) == tuple(item.size):
            flat[key] = torch.empty_like(target, dtype=dtype)
        else:
            flat[key] = torch.empty(tuple(item.size), dtype=dtype)
    with _quiet_single_process():
        # Each process reads what it needs on its own: no collective, so no worker waits
        # for another (or hangs when only some restore).
        try:
            dcp.load(flat, storage_reader=reader, no_dist=True)
        except BaseException:
            if reader.failure is not None:
                raise reader.failure from None
            raise
    return _join(layout, flat)


def _template_for(key: str, templates: dict[tuple[Any, ...], torch.Tensor]) -> torch.Tensor | None:
    """The template whose path leads to the saved tensor ``key`` (a JSON trail), if any."""
    try:
        trail = tuple(json.loads(key))
    except (ValueError, TypeError):
        return None
    for length in range(len(trail) - 1, 0, -1):
        template = templates.get(trail[:length])
        if template is not None:
            return template
    return None


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
    save_file(target, payload)
