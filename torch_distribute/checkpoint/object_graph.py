"""``Checkpoint``: named objects saved and restored together, and their owning strategy.

A ``Checkpoint`` groups named objects (modules, optimizers, LR schedulers, metrics, nested
checkpoints, tensors) and saves their states in one file. Files hold one logical copy of
every object, all tensors on the CPU, so a checkpoint written by any number of replicas or
workers loads into any other number, or with no strategy at all. The state of an object a
strategy captured is read and written through that strategy
(``strategy.extended.checkpoint_state`` / ``load_checkpoint_state``). Writes are collective:
every worker calls ``write``/``save``, the chief (``strategy.extended.should_checkpoint``)
writes the file, and every worker returns once it is complete (see ``collective``).

>>> import torch, torch_distribute as td
>>> ckpt = td.Checkpoint(model=torch.nn.Linear(2, 1), inner=td.Checkpoint(step=torch.zeros(())))
>>> sorted(ckpt.state_dict()["objects"])
['inner', 'model']
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from torch_distribute import context
from torch_distribute.checkpoint.collective import write_collectively
from torch_distribute.checkpoint.file_io import (
    FORMAT,
    VERSION,
    CorruptCheckpointError,
    check_payload,
    checkpoint_exists,
    directory_of,
    is_sharded_checkpoint,
    load_payload,
    remove_stale_temporaries,
    save_file,
)
from torch_distribute.checkpoint.index import missing_path_error, read_index, write_index
from torch_distribute.errors import CheckpointError, ContextError, InvalidArgumentError
from torch_distribute.strategies import owner_of
from torch_distribute.values import is_dtensor

__all__ = [
    "Checkpoint",
    "CheckpointLoadStatus",
    "owning_strategy",
    "write_checkpoint_file",
]

_RESERVED = frozenset({"save_counter"})


def _to_cpu(value: Any) -> Any:
    """``value`` with every tensor detached and on the CPU (dicts, lists, tuples recursed);
    sharded tensors (DTensors) stay where they are, each worker writes its own shard."""
    if is_dtensor(value):
        return value.detach()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        out: dict[Any, Any] = OrderedDict() if isinstance(value, OrderedDict) else {}
        for key, item in value.items():
            out[key] = _to_cpu(item)
        metadata = getattr(value, "_metadata", None)  # nn.Module state-dict versions
        if metadata is not None and isinstance(out, OrderedDict):
            out._metadata = metadata  # type: ignore[attr-defined]
        return out
    if isinstance(value, list):
        return [_to_cpu(item) for item in value]
    if isinstance(value, tuple):
        items = [_to_cpu(item) for item in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def owning_strategy(objects: Iterable[Any]) -> Any:
    """The strategy in scope, else the one the objects (or nested checkpoints) belong to."""
    if context.has_strategy():
        return context.get_strategy()
    pending = list(objects)
    while pending:
        obj = pending.pop()
        if isinstance(obj, Checkpoint):
            pending.extend(obj._objects.values())
            continue
        owner = owner_of(obj)
        if owner is not None:
            return owner
    return context.get_strategy()


def _object_strategy(obj: Any) -> Any | None:
    """The strategy that captured ``obj``, else the one in scope; ``None`` without either."""
    owner: object | None = owner_of(obj)
    if owner is None and context.has_strategy():
        owner = context.get_strategy()
    return owner


def _object_state(obj: Any) -> Any:
    """What a checkpoint saves for ``obj`` (before moving it to the CPU)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    strategy = None if isinstance(obj, Checkpoint) else _object_strategy(obj)
    return obj.state_dict() if strategy is None else strategy.extended.checkpoint_state(obj)


def _check_not_in_replica(method: str) -> None:
    if context.has_strategy() and not context.in_cross_replica_context():
        raise ContextError(
            f"Checkpoint.{method}() was called inside strategy.run(); call it from the "
            "training loop outside run() (cross-replica context), once per step."
        )


class CheckpointLoadStatus:
    """What a ``read``/``restore`` matched: returned so callers can check it.

    ``missing`` lists objects of the checkpoint that the file had no value for (left
    unchanged), ``unexpected`` the values in the file that no object took.
    """

    def __init__(self, path: str | None, missing: list[str], unexpected: list[str]):
        self.path = path
        self.missing = tuple(missing)
        self.unexpected = tuple(unexpected)

    def assert_consumed(self) -> CheckpointLoadStatus:
        """Raise ``CheckpointError`` unless every object and every saved value matched."""
        if self.missing or self.unexpected:
            problems = []
            if self.missing:
                problems.append(f"objects with nothing saved for them: {list(self.missing)}")
            if self.unexpected:
                problems.append(f"saved values with no object to restore into: {list(self.unexpected)}")
            raise CheckpointError(
                f"Checkpoint {self.path!r} did not match the objects restored: "
                + "; ".join(problems)
                + ". Give the Checkpoint the same object names as when it was saved, or call "
                "expect_partial() if a partial restore is intended."
            )
        return self

    def expect_partial(self) -> CheckpointLoadStatus:
        """Declare that a partial restore is intended (no-op, for TF compatibility)."""
        return self


class Checkpoint:
    """Groups named objects so they are saved and restored together.

    Each object has ``state_dict()``/``load_state_dict()`` (``nn.Module``, optimizers, LR
    schedulers, metrics, another ``Checkpoint``) or is a ``torch.Tensor`` (saved by value,
    restored in place). Counters must be tensors so they can be restored in place.

    >>> import tempfile, os, torch, torch_distribute as td
    >>> model = torch.nn.Linear(2, 1)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> ckpt = td.Checkpoint(model=model, optimizer=optimizer)
    >>> path = ckpt.save(os.path.join(tempfile.mkdtemp(), "ckpt"))
    >>> ckpt.save_counter
    1
    >>> fresh = torch.nn.Linear(2, 1)
    >>> _ = td.Checkpoint(model=fresh).read(path)  # model only: optimizer left unread
    >>> torch.equal(fresh.weight, model.weight)
    True
    """

    def __init__(self, **objects: Any):
        for name, obj in objects.items():
            if name in _RESERVED or hasattr(Checkpoint, name):
                raise InvalidArgumentError(
                    f"'{name}' is reserved by Checkpoint (an attribute or method name); give "
                    "the object another name."
                )
            if isinstance(obj, torch.Tensor):
                continue
            if isinstance(obj, type):
                raise InvalidArgumentError(
                    f"Checkpoint object '{name}' is the class {obj.__name__}, not an instance; "
                    f"pass the object itself, e.g. {name}={obj.__name__}(...)."
                )
            if not (callable(getattr(obj, "state_dict", None))
                    and callable(getattr(obj, "load_state_dict", None))):
                raise InvalidArgumentError(
                    f"Checkpoint object '{name}' of type {type(obj).__name__} cannot be saved: "
                    "pass objects with state_dict()/load_state_dict() (modules, optimizers, "
                    "schedulers, metrics, Checkpoints) or tensors. Wrap a counter in a tensor, "
                    "e.g. step = torch.zeros((), dtype=torch.int64), and update it in place "
                    "(step += 1)."
                )
        self._objects: dict[str, Any] = dict(objects)
        self.save_counter: int = 0

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"{type(self).__name__} has no attribute or object {name!r}")

    def __repr__(self) -> str:
        return f"Checkpoint({', '.join(self._objects)}; save_counter={self.save_counter})"

    # -- state -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"save_counter": n, "objects": {name: state}}``, tensors on the CPU."""
        objects = {name: _to_cpu(_object_state(obj)) for name, obj in self._objects.items()}
        return {"save_counter": self.save_counter, "objects": objects}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from ``state_dict()`` output (objects absent from it are left as they are)."""
        self._load(state_dict, restore_counter=True, prefix="")

    def _load(self, state: Any, restore_counter: bool, prefix: str) -> tuple[list[str], list[str]]:
        """Restore every object found in ``state``; return (missing, unexpected) names."""
        if not isinstance(state, dict) or not isinstance(state.get("objects"), dict):
            raise CheckpointError(
                f"The saved value for Checkpoint '{prefix.rstrip('.') or '<root>'}' is not a "
                "torch-distribute checkpoint state ({'save_counter', 'objects'})."
            )
        saved = state["objects"]
        missing = [prefix + name for name in self._objects if name not in saved]
        unexpected = [prefix + name for name in saved if name not in self._objects]
        for name, obj in self._objects.items():
            if name not in saved:
                continue
            if isinstance(obj, Checkpoint):
                sub_missing, sub_unexpected = obj._load(saved[name], restore_counter, f"{prefix}{name}.")
                missing += sub_missing
                unexpected += sub_unexpected
            else:
                _load_object(prefix + name, obj, saved[name])
        if restore_counter and isinstance(state.get("save_counter"), int):
            self.save_counter = state["save_counter"]
        return missing, unexpected

    # -- writing ---------------------------------------------------------------------
    def write(self, path: str | os.PathLike[str]) -> str:
        """Write exactly ``path``: no numbering, no index, ``save_counter`` unchanged.

        Under several workers every worker calls it and returns only once the chief's file
        is complete, so a ``read(path)`` on every worker right after reads the same file. A
        worker that passes another path than the chief's writes its own copy there (TF's
        ``write_filepath`` for non-chiefs); one that passes the chief's path but does not
        see the chief's file there (its own disk) writes its copy too. Returns ``path``,
        which exists on every worker. Raises ``CheckpointError`` on every worker if the
        chief's write fails. The file carries a SHA-256 checksum (see ``file_io``).

        >>> import tempfile, os, torch, torch_distribute as td
        >>> ckpt = td.Checkpoint(w=torch.ones(2))
        >>> path = ckpt.write(os.path.join(tempfile.mkdtemp(), "weights.pt"))
        >>> _ = ckpt.read(path)
        """
        path = os.fspath(path)
        write_checkpoint_file(self, path, self.save_counter, "write")
        return path

    def save(self, file_prefix: str | os.PathLike[str]) -> str:
        """Write ``f"{file_prefix}-{n}"`` (``n`` = the incremented ``save_counter``).

        Also records the file as the latest in the directory's ``checkpoint`` index, which
        ``td.latest_checkpoint`` reads. Returns the path written. Collective under several
        workers, as ``write``: the file and the index are complete on every worker's return.

        >>> import tempfile, os, torch, torch_distribute as td
        >>> ckpt = td.Checkpoint(step=torch.zeros((), dtype=torch.int64))
        >>> prefix = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> [os.path.basename(ckpt.save(prefix)) for _ in range(2)]
        ['ckpt-1', 'ckpt-2']
        """
        file_prefix = os.fspath(file_prefix)
        if not os.path.basename(file_prefix):
            raise InvalidArgumentError(
                f"file_prefix {file_prefix!r} names a directory; give a file name prefix too, "
                "e.g. os.path.join(directory, 'ckpt')."
            )
        number = self.save_counter + 1
        path = f"{file_prefix}-{number}"
        directory, basename = directory_of(path), os.path.basename(path)

        def record() -> None:
            index = read_index(directory) or {"all": []}
            names = [n for n in index["all"] if n != basename and checkpoint_exists(os.path.join(directory, n))]
            write_index(directory, basename, names + [basename])

        write_checkpoint_file(self, path, number, "save", after_write=record)
        self.save_counter = number
        return path

    # -- reading ---------------------------------------------------------------------
    def read(self, path: str | os.PathLike[str]) -> CheckpointLoadStatus:
        """Restore the objects from exactly ``path``; ``save_counter`` is left unchanged.

        Objects that have no value in the file are left as they are (see
        ``CheckpointLoadStatus.assert_consumed``).
        """
        return self._restore_from(os.fspath(path), restore_counter=False)

    def restore(self, save_path: str | os.PathLike[str] | None) -> CheckpointLoadStatus:
        """Like ``read``, and also restores ``save_counter``: the inverse of ``save``.

        ``None`` (what ``td.latest_checkpoint`` returns for an empty directory) restores
        nothing, so ``ckpt.restore(td.latest_checkpoint(directory))`` starts fresh or resumes.
        """
        if save_path is None:
            return CheckpointLoadStatus(None, list(self._objects), [])
        return self._restore_from(os.fspath(save_path), restore_counter=True)

    def _restore_from(self, path: str, restore_counter: bool) -> CheckpointLoadStatus:
        _check_not_in_replica("restore")
        if is_sharded_checkpoint(path):
            payload = self._read_sharded(path)
        elif os.path.isfile(path):
            payload = load_payload(path)
        else:
            raise missing_path_error(path)
        missing, unexpected = self._load(payload, restore_counter, prefix="")
        return CheckpointLoadStatus(path, missing, unexpected)


    def _shard_templates(self, prefix: tuple[Any, ...]) -> dict[tuple[Any, ...], torch.Tensor]:
        """Every object's ``checkpoint_shard_templates``, under its path in the payload."""
        templates: dict[tuple[Any, ...], torch.Tensor] = {}
        for name, obj in self._objects.items():
            if isinstance(obj, Checkpoint):
                templates.update(obj._shard_templates((*prefix, name, "objects")))
                continue
            strategy = None if isinstance(obj, torch.Tensor) else _object_strategy(obj)
            if strategy is not None:
                for path, tensor in strategy.extended.checkpoint_shard_templates(obj).items():
                    templates[prefix + (name, *path)] = tensor
        return templates

    def _read_sharded(self, path: str) -> dict[str, Any]:
        """Read a sharded checkpoint: the shards of objects that are sharded here, every
        other tensor whole."""
        from torch.distributed.checkpoint.api import CheckpointException

        from torch_distribute.checkpoint.sharded_io import read_sharded, split_tensors

        targets: dict[str, torch.Tensor] = {}
        templates: dict[tuple[Any, ...], torch.Tensor] = {}
        if owning_strategy([self]).extended.checkpoint_is_sharded:
            _, targets = split_tensors({"objects": self.state_dict()["objects"]})
            templates = self._shard_templates(("objects",))
        try:
            payload = read_sharded(path, targets, templates)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"Sharded checkpoint {path!r} could not be read: {exc}") from exc
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            raise CheckpointError(
                f"Sharded checkpoint {path!r} could not be read: {type(exc).__name__}: {exc}. "
                "The directory is incomplete or damaged; restore an earlier checkpoint."
            ) from exc
        return check_payload(path, payload)


def write_checkpoint_file(
    checkpoint: Checkpoint,
    path: str,
    save_counter: int,
    method: str,
    after_write: Callable[[], None] | None = None,
) -> None:
    """Serialize ``checkpoint`` with ``save_counter`` into ``path``; every worker calls it.

    The chief writes one file (a worker that asked for another path writes its own copy
    there; see ``collective``); under a sharded strategy every worker writes its shards into
    the directory ``path``. ``after_write()`` (the index, deleting old checkpoints) runs
    wherever the file is written, before any worker returns. ``method`` names the caller in
    errors. Counters are left unchanged. Raises ``CheckpointError`` on every worker if the
    chief's write fails.
    """
    _check_not_in_replica(method)
    state = checkpoint.state_dict()  # every worker computes it: metrics may reduce collectively
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "save_counter": save_counter,
        "objects": state["objects"],
    }
    extended = owning_strategy([checkpoint]).extended
    hint = ("Any previous checkpoint there is unchanged; check the disk space and that every "
            "state_dict() holds only tensors and plain Python values.")
    if extended.checkpoint_is_sharded:
        from torch.distributed.checkpoint.api import CheckpointException

        from torch_distribute.checkpoint.sharded_io import write_sharded

        try:
            # Every worker writes its own shards; the chief also writes the layout.
            write_sharded(path, payload, extended.should_checkpoint,
                          barrier=lambda what: extended.all_gather_objects(None, what),
                          gather=lambda value, what: extended.all_gather_objects(value, what), finish=after_write)
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as exc:
            raise CheckpointError(f"Could not write checkpoint {path!r}: {exc}. {hint}") from exc
        return

    def write() -> str:
        try:
            remove_stale_temporaries(directory_of(path))
            digest = save_file(path, payload)
            if after_write is not None:
                after_write()
        except CheckpointError:
            raise  # says what happened already (a full disk)
        except Exception as exc:
            raise CheckpointError(f"Could not write checkpoint {path!r}: {exc}. {hint}") from exc
        return digest

    write_collectively(extended, path, write)


def _load_object(name: str, obj: Any, state: Any) -> None:
    try:
        if isinstance(obj, torch.Tensor):
            if not isinstance(state, torch.Tensor):
                raise TypeError(f"saved value is a {type(state).__name__}, not a tensor")
            if state.shape != obj.shape:
                raise ValueError(
                    f"saved shape {tuple(state.shape)} != target shape {tuple(obj.shape)}"
                )
            with torch.no_grad():
                obj.copy_(state)
        else:
            strategy = _object_strategy(obj)
            if strategy is None:
                obj.load_state_dict(state)
            else:
                strategy.extended.load_checkpoint_state(obj, state)
    except Exception as exc:
        raise CheckpointError(
            f"Could not restore checkpoint object '{name}' ({type(obj).__name__}): {exc}. "
            "Build it exactly as when it was saved (same layer sizes, same parameters in the "
            "optimizer), or leave it out of the Checkpoint."
        ) from exc
