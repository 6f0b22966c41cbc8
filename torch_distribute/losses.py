"""Loss scaling for synchronous training: divide by the *global* batch, sum across replicas.

Gradients are SUMMED across replicas, so each replica's loss must be its share of the mean
over the global batch: ``sum(per_example_loss) / global_batch_size``. Then the summed
gradient is exactly the gradient of the mean loss over the whole global batch, as on one
device.

What holds, exactly:

- With ``global_batch_size=G`` (a constant), every step gives what one device gives running
  the same call, ``sum(per_example_loss) / G``, on the step's whole global batch. On a full
  batch that is the batch's mean. On a ragged last batch of ``b < G`` rows it is the mean
  times ``b / G``: that step's update is ``b / G`` of a mean-loss update (drop the last batch,
  ``DataLoader(..., drop_last=True)``, if that matters).
- Without ``global_batch_size``, the global batch is guessed as this replica's rows times
  ``num_replicas_in_sync`` (TensorFlow's rule): the mean over the step's batch when the
  replicas' rows are equal, which the batch split gives whenever the rows divide evenly. When
  they do not (7 rows over 3 replicas: 3, 3 and 1), the replicas' examples weigh differently
  and the gradient differs from one device's: a warning says so, once per calling line. When
  the batch came from a distributed dataset in an eager step, the warning appears exactly
  when the guess differs from the step's global rows; otherwise (a batch built by hand), when
  a call gets fewer rows than an earlier call from the same line.
- A ``global_batch_size`` passed smaller than the step's global batch (a dataset batched per replica
  or per worker while ``G`` counts the global batch) would weigh every example more than one
  device does: in an eager step whose batch came from a distributed dataset, that raises
  ``td.LossScalingError`` naming both numbers. (A guess below it, on the replica with fewer
  rows of an unevenly split batch, is TensorFlow's rule and warns as above.)
"""

from __future__ import annotations

import inspect
import threading
import warnings
import weakref
from typing import Any

import torch

from torch_distribute import context
from torch_distribute.errors import ContextError, InvalidArgumentError, LossScalingError
from torch_distribute.input import step_rows


def _require_replica_context(name: str) -> context.ReplicaContextLike:
    if context.in_cross_replica_context():
        raise ContextError(
            f"td.{name}() was called in cross-replica context; call it inside the function "
            "given to strategy.run() (replica context)."
        )
    replica = context.get_replica_context()
    assert replica is not None
    return replica


def compute_average_loss(
    per_example_loss: torch.Tensor,
    sample_weight: torch.Tensor | float | None = None,
    global_batch_size: int | None = None,
) -> torch.Tensor:
    """``sum(per_example_loss * sample_weight) / global_batch_size`` (0 when it is 0).

    >>> import torch, torch_distribute as td
    >>> td.compute_average_loss(torch.tensor([1.0, 2.0, 3.0]), global_batch_size=6)
    tensor(1.)
    """
    replica = _require_replica_context("compute_average_loss")
    loss = torch.as_tensor(per_example_loss)
    if loss.dim() == 0:
        raise InvalidArgumentError(
            "compute_average_loss expects per-example losses (a tensor with a batch dimension), "
            "got a scalar: compute the loss with reduction='none'."
        )
    if sample_weight is not None:
        loss = loss * _align_weight(torch.as_tensor(sample_weight, dtype=loss.dtype, device=loss.device), loss)
    # The step's rows, when its batch came from a distributed dataset and this loss has one
    # value per row of this replica's batch (eager steps: a compiled one does not look).
    rows = None if torch.compiler.is_compiling() else _step_rows_of(replica, loss)
    guessed = global_batch_size is None
    # A count computed in the step (a tensor: the valid examples of a masked batch, say) may
    # rightly be below the step's rows; only a number written in the program is checked.
    counted = isinstance(global_batch_size, torch.Tensor)
    if global_batch_size is None:
        global_batch_size = loss.shape[0] * replica.num_replicas_in_sync
        if rows is not None:
            if global_batch_size != rows.global_rows:
                _GUESSES.warn_inexact(replica, loss.shape[0], rows.global_rows, inspect.currentframe())
        elif not torch.compiler.is_compiling():
            _GUESSES.record(replica, loss.shape[0], inspect.currentframe())
    elif isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int):
        if isinstance(global_batch_size, torch.Tensor) and global_batch_size.dim() == 0 and not global_batch_size.is_floating_point():
            global_batch_size = int(global_batch_size)
        else:
            raise InvalidArgumentError(
                f"global_batch_size must be an int, got {type(global_batch_size).__name__}."
            )
    if global_batch_size < 0:
        raise InvalidArgumentError(f"global_batch_size must be >= 0, got {global_batch_size}.")
    if rows is not None and not guessed and not counted:  # a guess below the rows was warned about above
        if global_batch_size < rows.global_rows:
            raise LossScalingError(_too_small(global_batch_size, rows.global_rows, replica))
        _SHORT_STEPS.note(rows, global_batch_size, inspect.currentframe())
    total = loss.sum()
    if global_batch_size == 0:
        return total * 0.0
    return total / global_batch_size


def _step_rows(replica: context.ReplicaContextLike) -> step_rows.StepRows | None:
    return step_rows.current() if replica.num_replicas_in_sync > 1 else None


def _step_rows_of(replica: context.ReplicaContextLike, loss: torch.Tensor) -> step_rows.StepRows | None:
    """The step's rows if ``loss`` has one value per row of this replica's batch (a loss of
    more dimensions, one per token say, is divided by a count of its own)."""
    rows = _step_rows(replica)
    if rows is None or loss.dim() != 1:
        return None
    local = replica.local_replica_id
    if not 0 <= local < len(rows.replica_rows) or rows.replica_rows[local] != loss.shape[0]:
        return None
    return rows


def _too_small(global_batch_size: int, global_rows: int, replica: context.ReplicaContextLike) -> str:
    return (
        f"compute_average_loss(global_batch_size={global_batch_size}) on a step whose batches hold "
        f"{global_rows} rows over all {replica.num_replicas_in_sync} replicas: every example would "
        f"weigh 1/{global_batch_size} instead of at most 1/{global_rows}, a gradient "
        f"{global_rows / global_batch_size:g} times one device's. Either global_batch_size is not "
        "the global batch (it counts the rows of one step over every replica and worker), or the "
        "dataset is batched by more than the global batch: experimental_distribute_dataset takes "
        "batches of the global batch size under every shard policy, and a dataset made by "
        "distribute_datasets_from_function batches by ctx.get_per_replica_batch_size(GLOBAL_BATCH_SIZE)."
    )


def _calling_site(frame: Any) -> tuple[str, int] | None:
    """The file and line that called ``compute_average_loss`` (``frame``: its own)."""
    caller = frame.f_back if frame is not None else None
    return None if caller is None else (caller.f_code.co_filename, caller.f_lineno)


class _GuessedBatchSizes:
    """The most rows a call of ``compute_average_loss`` without ``global_batch_size`` got,
    per strategy and per calling line; a call with fewer warns once for that line."""

    _WARNED = -1  # in place of a line's largest batch once it warned

    def __init__(self) -> None:
        self._largest: weakref.WeakKeyDictionary[Any, dict[tuple[str, int], int]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def _sites(self, replica: context.ReplicaContextLike) -> dict[tuple[str, int], int] | None:
        """This strategy's entry per calling line (None: a strategy that cannot be weakly
        referenced is not tracked). Called holding the lock."""
        try:
            return self._largest.setdefault(replica.strategy, {})
        except TypeError:
            return None

    def record(self, replica: context.ReplicaContextLike, rows: int, frame: Any) -> None:
        """``frame``: ``compute_average_loss``'s own; the line that called it is the site."""
        site = _calling_site(frame)
        if site is None:
            return
        with self._lock:
            per_site = self._sites(replica)
            if per_site is None:
                return
            largest = per_site.get(site, 0)
            if largest == self._WARNED or rows >= largest:
                if largest != self._WARNED:
                    per_site[site] = rows
                return
            per_site[site] = self._WARNED
        replicas = replica.num_replicas_in_sync
        warnings.warn(
            f"td.compute_average_loss() without global_batch_size got {rows} rows on replica "
            f"{replica.replica_id_in_sync_group}, fewer than the {largest} of an earlier batch "
            f"({site[0]}:{site[1]}): the global batch is guessed as rows × replicas = "
            f"{rows} × {replicas} = {rows * replicas}, which is this step's global batch only if every "
            f"replica got {rows} rows; if the replicas got different numbers, their examples weigh "
            f"differently and the gradient differs from one device's mean. Pass "
            f"global_batch_size={largest * replicas} (the global batch: {largest} rows × {replicas} "
            f"replicas; one device running the same call then gives the same result, the last batch "
            f"weighing by its rows), or feed the step from strategy.experimental_distribute_dataset, "
            f"whose steps tell compute_average_loss their global rows.",
            UserWarning,
            stacklevel=3,
        )

    def warn_inexact(self, replica: context.ReplicaContextLike, rows: int, global_rows: int, frame: Any) -> None:
        """The guess ``rows × replicas`` is not the step's ``global_rows``: warn once per line."""
        site = _calling_site(frame)
        if site is None:
            return
        with self._lock:
            per_site = self._sites(replica)
            if per_site is None or per_site.get(site) == self._WARNED:
                return
            per_site[site] = self._WARNED
        replicas = replica.num_replicas_in_sync
        warnings.warn(
            f"td.compute_average_loss() without global_batch_size got {rows} rows on replica "
            f"{replica.replica_id_in_sync_group} ({site[0]}:{site[1]}): the global batch is guessed as "
            f"rows × replicas = {rows} × {replicas} = {rows * replicas}, but this step's global batch "
            f"has {global_rows} rows (split unevenly over the replicas), so the examples of different "
            f"replicas weigh differently and the gradient differs from one device's mean. Pass "
            f"global_batch_size=GLOBAL_BATCH_SIZE (the dataset's; one device running the same call "
            f"then gives the same result), or use a global batch size divisible by {replicas}.",
            UserWarning,
            stacklevel=3,
        )


_GUESSES = _GuessedBatchSizes()


class _ShortSteps:
    """Steps whose global batch held fewer rows than ``global_batch_size`` and that turned out
    not to be the last of their epoch (a later step of the same iteration came): their
    examples weighed less than one device's mean gives them. Warned once per calling line."""

    _KEPT = 16  # iterations with a short step remembered (older ones ended: a last batch)

    def __init__(self) -> None:
        self._pending: dict[int, tuple[int, int, int]] = {}  # iteration -> (step, G, rows)
        self._warned: set[tuple[str, int]] = set()
        self._lock = threading.Lock()

    def note(self, rows: step_rows.StepRows, global_batch_size: int, frame: Any) -> None:
        site = _calling_site(frame) or ("?", 0)
        with self._lock:
            pending = self._pending.get(rows.iteration)
            warn = pending is not None and pending[0] < rows.step and site not in self._warned
            if pending is not None and pending[0] < rows.step:
                del self._pending[rows.iteration]
            if warn:
                self._warned.add(site)
            if global_batch_size > rows.global_rows:
                self._pending[rows.iteration] = (rows.step, global_batch_size, rows.global_rows)
                while len(self._pending) > self._KEPT:
                    del self._pending[min(self._pending)]
        if warn and pending is not None:
            step, size, held = pending
            warnings.warn(
                f"td.compute_average_loss(global_batch_size={size}) ({site[0]}:{site[1]}) at step {step} "
                f"of this epoch, whose batches held {held} rows over all replicas and workers, and the "
                f"epoch went on: that step's examples weighed 1/{size} instead of 1/{held}, a gradient "
                f"{held / size:g} times one device's mean over the step. Every step but an epoch's last "
                f"should hold global_batch_size rows: batch the dataset by the global batch size (under "
                f"every shard policy, a DataLoader with a DistributedSampler under AutoShardPolicy.OFF "
                f"included), or pass the global batch size the dataset is batched by.",
                UserWarning,
                stacklevel=3,
            )


_SHORT_STEPS = _ShortSteps()


def _align_weight(weight: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """Squeeze or expand trailing dims of ``weight`` to the loss's rank (as TF does)."""
    while weight.dim() > loss.dim() and weight.shape[-1] == 1:
        weight = weight.squeeze(-1)
    while 0 < weight.dim() < loss.dim():
        weight = weight.unsqueeze(-1)
    if weight.dim() > loss.dim():
        raise InvalidArgumentError(
            f"sample_weight of shape {tuple(weight.shape)} does not fit per-example losses of "
            f"shape {tuple(loss.shape)}."
        )
    return weight


def scale_regularization_loss(regularization_loss: torch.Tensor | list[torch.Tensor] | Any) -> torch.Tensor:
    """``sum(regularization_loss) / num_replicas_in_sync``: counted once after the SUM.

    >>> import torch, torch_distribute as td
    >>> td.scale_regularization_loss([torch.tensor(1.0), torch.tensor(2.0)])
    tensor(3.)
    """
    replica = _require_replica_context("scale_regularization_loss")
    if isinstance(regularization_loss, (list, tuple)):
        if not regularization_loss:
            return torch.tensor(0.0)
        total = torch.stack([torch.as_tensor(x).sum() for x in regularization_loss]).sum()
    else:
        total = torch.as_tensor(regularization_loss).sum()
    return total / replica.num_replicas_in_sync
