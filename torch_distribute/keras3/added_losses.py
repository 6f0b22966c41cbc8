"""Losses a served model's layers add in its forward, combined over the replicas as one device's.

Each replica's forward adds its losses (``add_loss``, activity regularizers) computed on its
own rows; one device computes them once, on the whole global batch. Two kinds of loss combine
exactly, each by its own rule:

- **a mean over the batch's rows** (Keras' activity regularizers, an ``add_loss`` of
  ``ops.mean(...)``), or a value that does not depend on the rows (a penalty on the weights
  added in ``call``): one device's value is the replicas' values weighted by their share of
  the global batch, summed over every replica and worker;
- **a sum over the rows** (``add_loss(ops.sum(...))``): one device's value is the replicas'
  values summed.

Keras does not say which kind a loss is, so the first step that adds losses finds out
(``classify``), by testing the very property each rule relies on: on the calling thread,
changing nothing (a ``keras.StatelessScope``, no gradient, torch's generators restored), the
model's forward on one replica's rows, and on the two halves of those rows. A mean's value on
the rows is its halves' weighted by their rows, a sum's is its halves' summed. This runs in
inference mode (deterministic), or in training mode with a looser tolerance where inference
adds other losses. Workers agree on the answer (one small gather). A loss that is neither (a
maximum or a variance over the batch: no split of the batch gives it as one device computes
it), or workers that disagree, raise ``KerasUnsupportedError`` at that first step: never a
silently different loss. The answer is kept per model until the number of added losses
changes; a loss that was zero on the rows tried cannot tell, and the next steps try again
(``MAX_TRIES``; meanwhile, and after, it is combined as a mean).

>>> kind_of(6.0, (2.0, 4.0), (1, 1), tolerance=1e-3), kind_of(3.0, (2.0, 4.0), (1, 1), tolerance=1e-3)
('sum', 'mean')
>>> kind_of(4.0, (2.0, 4.0), (1, 1), tolerance=1e-3), kind_of(0.0, (0.0, 0.0), (1, 1), tolerance=1e-3)
('neither', 'unknown')
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from torch_distribute import nest
from torch_distribute.errors import KerasUnsupportedError

if TYPE_CHECKING:
    from torch_distribute.strategies import Strategy

_CODES = {"unknown": 0, "mean": 1, "sum": 2, "neither": 3}
_KINDS = {code: kind for kind, code in _CODES.items()}
#: Steps that try again to tell a loss's kind (its values so far were zero): then it is taken
#: as a mean (a loss zero on every row tried so far).
MAX_TRIES = 8
_kinds: weakref.WeakKeyDictionary[Any, tuple[tuple[str, ...], int]] = weakref.WeakKeyDictionary()


def kind_of(whole: float, halves: tuple[float, float], rows: tuple[int, int], tolerance: float) -> str:
    """``"mean"`` (or constant), ``"sum"``, ``"neither"`` or ``"unknown"``: how a loss's value
    on some rows (``whole``) compares with its values on two halves of them of ``rows`` rows."""
    first, second = halves
    as_mean = (first * rows[0] + second * rows[1]) / (rows[0] + rows[1])
    as_sum = first + second
    values = (whole, first, second)
    if not all(abs(v) < float("inf") for v in values):
        return "unknown"
    scale = max(abs(v) for v in values)
    if scale == 0.0 or abs(as_sum - as_mean) <= tolerance * scale:
        return "unknown"  # zeros, or values for which both rules agree
    off_mean, off_sum = abs(whole - as_mean), abs(whole - as_sum)
    if min(off_mean, off_sum) > tolerance * scale:
        return "neither"
    return "mean" if off_mean <= off_sum else "sum"


def kinds(strategy: Strategy, keras: ModuleType, model: Any, count: int, rows_args: tuple, rows_kwargs: dict,
          device: torch.device) -> tuple[str, ...]:
    """The kind of each of the ``count`` losses ``model``'s forward adds (kept per model), found
    with ``rows_args``/``rows_kwargs`` (one replica's rows, none where this worker has none)."""
    known, tries = _kinds.get(model, ((), 0))
    if len(known) == count and ("unknown" not in known or tries >= MAX_TRIES):
        return known
    local = classify(keras, model, count, rows_args, rows_kwargs, device)
    agreed = _agree(strategy, model, local)
    _kinds[model] = (agreed, tries + 1 if len(known) == count else 1)
    return agreed


def classify(keras: ModuleType, model: Any, count: int, rows_args: tuple, rows_kwargs: dict,
             device: torch.device) -> tuple[str, ...]:
    """This worker's answer (``"unknown"`` for every loss where it has no rows or cannot tell).
    One row is split as its two copies (a mean keeps its value on them, a sum doubles)."""
    rows = _rows(rows_args)
    if rows == 0:
        return ("unknown",) * count
    if rows == 1:
        rows_args, rows_kwargs, rows = _cat(rows_args, 1), _cat(rows_kwargs, 1), 2
    half = rows // 2
    parts = [(_cut(rows_args, rows, start, size), _cut(rows_kwargs, rows, start, size))
             for start, size in ((0, half), (half, rows - half))]
    for training, tolerance in ((False, 1e-3), (True, 0.25)):
        whole = _losses(keras, model, rows_args, rows_kwargs, device, training)
        first, second = (_losses(keras, model, a, k, device, training) for a, k in parts)
        if len(whole) == len(first) == len(second) == count:
            return tuple(kind_of(w, (a, b), (half, rows - half), tolerance)
                         for w, a, b in zip(whole, first, second, strict=True))
    return ("neither",) * count


def _losses(keras: ModuleType, model: Any, args: tuple, kwargs: dict, device: torch.device,
            training: bool) -> list[float]:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad(), keras.device(str(device)), \
            keras.StatelessScope(collect_losses=True) as scope:
        model(*args, **{**kwargs, "training": training})
    return [float(loss.detach().float().sum()) for loss in scope.losses]


def _rows(args: tuple) -> int:
    for leaf in nest.leaves(args):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
    return 0


def _cat(structure: Any, rows: int) -> Any:
    """Every batched tensor of ``structure`` twice over (its rows, then its rows again)."""
    return nest.map_structure(
        lambda leaf: torch.cat([leaf, leaf]) if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1
        and leaf.shape[0] == rows else leaf, structure)


def _cut(structure: Any, rows: int, start: int, size: int) -> Any:
    return nest.map_structure(
        lambda leaf: leaf[start:start + size] if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1
        and leaf.shape[0] == rows else leaf, structure)


def _agree(strategy: Strategy, model: Any, local: tuple[str, ...]) -> tuple[str, ...]:
    """Every worker's answers, as one; ``KerasUnsupportedError`` on every worker where a loss is
    neither kind, or where workers disagree."""
    extended = strategy.extended
    codes = torch.tensor([[_CODES[kind] for kind in local]], dtype=torch.int64)
    every = extended.gather_across_workers(codes, 0) if extended.num_workers_in_sync > 1 else codes
    agreed = []
    for index in range(len(local)):
        seen = {_KINDS[int(code)] for code in every[:, index].tolist()} - {"unknown"}
        if "neither" in seen or len(seen) > 1:
            found = ("is neither a mean over the batch's rows nor a sum over them: its value on some rows "
                     "is neither its values on their halves weighted by their rows nor their sum"
                     if "neither" in seen else
                     f"was found a mean on some workers and a sum on others ({sorted(seen)})")
            raise KerasUnsupportedError(
                f"Loss {index + 1} of the {len(local)} that {type(model).__name__}'s layers add in their "
                f"forward (add_loss, activity regularizers) {found}. Under {type(strategy).__name__} "
                f"with {strategy.num_replicas_in_sync} replicas each replica computes it on its own "
                "rows, and only a mean (or a value independent of the rows) or a sum can be combined "
                "into one device's. Add a mean (ops.mean) or a sum (ops.sum) over the batch, or compute "
                "such a loss in compute_loss/train_step on the whole batch's outputs."
            )
        agreed.append(seen.pop() if seen else "unknown")
    return tuple(agreed)


def combine(strategy: Strategy, losses_by_replica: Sequence[Sequence[torch.Tensor]], sizes: Sequence[int],
            rows: int, loss_kinds: Sequence[str]) -> torch.Tensor:
    """This worker's share of one device's added loss: each replica's mean-kind losses weighted
    by its share of the global batch, its sum-kind ones as they are (differentiable)."""
    device = strategy.extended.primary_device
    local = torch.zeros((), device=device)
    for losses, size in zip(losses_by_replica, sizes, strict=True):
        if size == 0:
            continue  # no rows: its means are over nothing (NaN) and its sums are 0
        for loss, kind in zip(losses, loss_kinds, strict=True):
            weight = 1.0 if kind == "sum" else size / rows  # a mean, a constant, or still unknown
            local = local + loss.to(device).float().sum() * weight
    return local
