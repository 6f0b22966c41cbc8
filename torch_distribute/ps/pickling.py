"""How scheduled functions and their arguments travel from the coordinator to a worker.

Functions and classes are pickled *by reference* (module and name), exactly as
``multiprocessing`` does: every task runs the same program, so define scheduled functions
and model classes at the top level of the script (or in an importable module), and run the
program under ``if __name__ == "__main__":``.

Objects made in ``strategy.scope()`` never travel by value. They pickle as *references*
(``persistent_id``): ``("module", k)``, ``("optimizer", k)``, ``("var", k)``,
``("per_worker", k)``, ``("strategy",)``; a worker resolves each to its own copy, fetched
once from the coordinator (a module's architecture, with its parameters as variable
references) and kept for later functions.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torch_distribute.errors import InvalidArgumentError

Reference = tuple[Any, ...]


class ReferencePickler(pickle.Pickler):
    """Pickles with ``reference(obj) -> Reference | None`` deciding what goes by reference."""

    def __init__(self, file: io.BytesIO, reference: Callable[[Any], Reference | None]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._reference = reference

    def persistent_id(self, obj: Any) -> Reference | None:
        return self._reference(obj)


class ReferenceUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, resolve: Callable[[Reference], Any]):
        super().__init__(file)
        self._resolve = resolve

    def persistent_load(self, pid: Reference) -> Any:
        return self._resolve(tuple(pid))


def dumps(obj: Any, reference: Callable[[Any], Reference | None], what: str) -> bytes:
    buffer = io.BytesIO()
    try:
        ReferencePickler(buffer, reference).dump(obj)
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        if isinstance(error, InvalidArgumentError):
            raise
        raise InvalidArgumentError(
            f"Cannot send {what} to the workers: {error}. Scheduled functions, model classes "
            "and dataset functions must be defined at the top level of the script (or of an "
            "importable module), not inside a function or as a lambda: every task runs the same "
            "program and finds them by name. Pass the model, optimizer and per-worker iterators "
            "as arguments (args=...) or bind them with functools.partial."
        ) from error
    return buffer.getvalue()


def loads(data: bytes, resolve: Callable[[Reference], Any]) -> Any:
    return ReferenceUnpickler(io.BytesIO(data), resolve).load()


def detach_result(value: Any) -> Any:
    """A scheduled function's return value, made picklable (tensors detached, on the CPU)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return type(value)((k, detach_result(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(detach_result(v) for v in value)
    if isinstance(value, tuple):
        return type(value)(*(detach_result(v) for v in value))
    if isinstance(value, nn.Module):
        raise InvalidArgumentError("A scheduled function returned a module; return tensors or numbers.")
    return value
