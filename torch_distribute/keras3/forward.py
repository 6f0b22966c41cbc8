"""The forward of a served Keras model within a step: its global batch spread over the replicas.

Within ``train_step``/``test_step``/``predict_step`` (``step_context``), the model's call on
the global batch is cut as a distributed dataset cuts it (``input/batching.py``: sub-batches
whose sizes differ by at most one, worker by worker, replica by replica). Each local replica
runs the whole Keras call (``model(x_k, training=...)``: its own call context, autocast and
masks) in ``strategy.run``, so it computes with its own copies of the variables, on its own
device (``keras.device``). The replicas' outputs are concatenated on the primary device and,
with several workers, gathered from every worker in worker order.

Everything after the forward (the loss, the metrics, a ``train_step`` of the user's own)
then sees the outputs of the whole global batch, on every worker, exactly as one device
would: the loss is the one-device loss, and backward gives each replica (through the
concatenation) and each worker (through ``GatheredRows``, whose backward keeps this worker's
rows of the gradient: every worker computed the same loss) its share of the gradient, which
the optimizer sums (``gradients.py``).

Each replica's forward runs in a ``keras.StatelessScope`` of its own, with random numbers of
its own (``replica_random.py``): what it assigns to the model's variables
(``BatchNormalization``'s moving statistics, a seed generator's state) and
the losses it adds (``add_loss``, activity regularizers) are collected, not applied, so every
replica computes from the same state. Then floating variables get the mean over the replicas
and workers (as TensorFlow's ON_READ MEAN variables), others replica 0's value, and the added
losses are added to the model as one device would have them (``added_losses.py``: a mean over
the rows weighted by each replica's share of the global batch, a sum as it is, summed over
every replica and worker).

>>> row_ranges(7, num_workers=2, num_local_replicas=2, worker_index=1)
(4, [2, 1])
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from torch_distribute import context, nest
from torch_distribute.errors import KerasUnsupportedError
from torch_distribute.input.batching import batch_sizes_for_worker
from torch_distribute.keras3 import added_losses, keras_seams, replica_random
from torch_distribute.reduce_op import ReduceOp
from torch_distribute.values import PerReplica, select_replica

if TYPE_CHECKING:
    from torch_distribute.strategies import Strategy


def row_ranges(rows: int, num_workers: int, num_local_replicas: int, worker_index: int) -> tuple[int, list[int]]:
    """Where this worker's rows of a global batch start, and how many each of its replicas
    gets (the cut of ``input/batching.py``, in global replica order)."""
    sizes = batch_sizes_for_worker(rows, num_workers, num_local_replicas, 0)
    first = worker_index * num_local_replicas
    return sum(sizes[:first]), sizes[first:first + num_local_replicas]


def batch_rows(inputs: Any) -> int | None:
    """The batch size of ``inputs`` (the first dimension of its tensors), or ``None`` where it
    has no batched tensor."""
    for leaf in nest.leaves(inputs):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
    return None


def _rows(structure: Any, rows: int, start: int, count: int) -> Any:
    """Rows ``start:start+count`` of every tensor in ``structure`` with ``rows`` rows."""
    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 and leaf.shape[0] == rows:
            return leaf[start:start + count]
        return leaf
    return nest.map_structure(cut, structure)


def spread(strategy: Strategy, keras: ModuleType, model: Any, args: tuple, kwargs: dict, training: bool) -> Any:
    """``model(*args, **kwargs)`` on the global batch in ``args[0]``, computed by every replica
    of every worker on its rows; the outputs of the whole batch."""
    extended = strategy.extended
    rows = batch_rows(args[0])
    if rows is None:
        raise KerasUnsupportedError(
            f"A {type(model).__name__} called with no batched tensor in its first argument inside "
            f"a step under {type(strategy).__name__}: the batch cannot be spread over the replicas."
        )
    start, local_sizes = row_ranges(rows, extended.num_workers_in_sync, extended.num_local_replicas,
                                    extended.worker_index)
    local_rows = sum(local_sizes)
    per_replica, offset = [], start
    for size in local_sizes:
        per_replica.append((_rows(args, rows, offset, size), _rows(kwargs, rows, offset, size)))
        offset += size
    devices = extended.replica_devices
    # What the forwards may assign: every non-trainable variable in training (BatchNormalization's
    # statistics), the seed generators' states always (a random layer draws in inference too).
    states = [v for v in model.non_trainable_variables if training or replica_random.is_seed_state(v)]

    def replica_forward(inputs: tuple[tuple, dict]) -> Any:
        replica_args, replica_kwargs = inputs
        replica = context.get_replica_context()
        device, replica_id = devices[replica.local_replica_id], replica.replica_id_in_sync_group
        # The replica's variable updates and added losses are collected, not applied: each
        # replica computes from the same state, and the updates are combined below. Its random
        # numbers are its own (replica_random.py).
        mapping = replica_random.seeded_mapping(states, replica_id)
        # A replica without rows (fewer rows than replicas) still runs, for its shapes, but
        # outside autograd: statistics over no rows are NaN (BatchNormalization's), and its
        # backward would carry them into the weights' gradients as NaN * 0.
        empty = local_sizes[replica.local_replica_id] == 0
        with keras.device(str(device)), keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope, \
                replica_random.own_torch_stream(device, replica_id), torch.no_grad() if empty else nullcontext():
            out = model(*_on(replica_args, device), **_on(replica_kwargs, device))
        return out, _Collected(list(scope.losses), [_assigned(scope, v, replica_id) for v in states])

    value: Any = PerReplica(per_replica) if len(per_replica) > 1 else per_replica[0]
    result = strategy.run(replica_forward, args=(value,))
    results = [select_replica(k, result) for k in range(len(per_replica))]
    collected = [r[1] for r in results]
    _add_losses(strategy, keras, model, collected, local_sizes, rows, per_replica)
    if states:
        _update_states(strategy, states, collected, local_sizes)
    outputs = tuple(r[0] for r in results)
    local = _concatenate(outputs, local_sizes, extended.primary_device, model)
    masks = _concatenate(tuple(nest.map_structure(lambda t: _mask_of(keras, t), out) for out in outputs),
                         local_sizes, extended.primary_device, model)
    if extended.num_workers_in_sync > 1:
        local = nest.map_structure(lambda t: gather_rows(extended, t, start, local_rows), local)
        masks = nest.map_structure(lambda m: extended.gather_across_workers(m, 0) if isinstance(m, torch.Tensor) else m,
                                   masks)
    for tensor, mask in zip(nest.leaves(local), nest.leaves(masks), strict=True):
        if isinstance(tensor, torch.Tensor) and isinstance(mask, torch.Tensor):
            keras_seams.set_output_mask(keras, tensor, mask)
    return local


def in_replica(strategy: Strategy, keras: ModuleType, model: Any, call: Callable[..., Any], args: tuple,
               kwargs: dict) -> Any:
    """``call(*args, **kwargs)``, the model's forward inside ``strategy.run`` (a custom training
    loop), as each replica of one device's step: with random numbers of its own
    (``replica_random``), and what it assigns to the model's state applied once for every
    replica in a ``merge_call`` (``BatchNormalization``'s moving statistics: the mean over the
    replicas and workers, as TensorFlow's ON_READ MEAN variables read).

    The losses the forward adds (``add_loss``, activity regularizers) are the model's, as Keras
    keeps them (``model.losses``), where this process runs one replica; several replica threads
    would share that list, so there they raise ``KerasUnsupportedError``."""
    replica = context.get_replica_context()
    extended = strategy.extended
    device, replica_id = extended.replica_devices[replica.local_replica_id], replica.replica_id_in_sync_group
    states = list(model.non_trainable_variables)
    mapping = replica_random.seeded_mapping(states, replica_id)
    with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope, \
            replica_random.own_torch_stream(device, replica_id):
        out = call(*args, **kwargs)
    collected = _Collected(list(scope.losses), [_assigned(scope, v, replica_id) for v in states])
    if collected.losses:
        if extended.num_local_replicas > 1:
            raise KerasUnsupportedError(
                f"{type(model).__name__}'s layers added losses in their forward (add_loss, activity "
                f"regularizers) inside {type(strategy).__name__}.run with {extended.num_local_replicas} "
                "replicas in this process: Keras keeps them in one list per layer (model.losses), which "
                "the replicas' threads would overwrite. Train with fit (it combines them as one device), "
                "or one replica per process (MultiWorkerMirroredStrategy), or compute the term in the "
                "step from the model's outputs."
            )
        for loss in collected.losses:
            model.add_loss(loss)
    if states:
        def merge(merged_strategy: Strategy, per_replica: Any) -> None:
            parts = per_replica.values if isinstance(per_replica, PerReplica) else (per_replica,)
            _update_states(merged_strategy, states, list(parts))

        replica.merge_call(merge, args=(collected,))
    return out


def _assigned(scope: Any, variable: Any, replica_id: int) -> Any:
    """What a replica's forward assigned to ``variable`` (``None``: nothing); a seed state
    without the replica's offset (``None`` where the forward drew nothing from it)."""
    value = scope.get_current_value(variable)
    if value is None or not replica_random.is_seed_state(variable):
        return value
    value = replica_random.without_offset(value, replica_id)
    return None if torch.equal(value, variable.value.to(value.device)) else value


def _mask_of(keras: ModuleType, tensor: Any) -> Any:
    """The mask Keras attached to a replica's output (a placeholder leaf where none)."""
    mask = keras_seams.output_mask(keras, tensor) if isinstance(tensor, torch.Tensor) else None
    return mask if mask is not None else _NO_MASK


_NO_MASK = "no mask"  # a leaf every replica shares, so the masks' nest has the outputs' shape


class _Collected:
    """What one replica's forward added (losses) and changed (the state variables' values, or
    ``None`` where unchanged), carried out of ``strategy.run`` as one value."""

    __slots__ = ("losses", "values")

    def __init__(self, losses: list[Any], values: list[Any]):
        self.losses = losses
        self.values = values


def _add_losses(strategy: Strategy, keras: ModuleType, model: Any, collected: list[_Collected], sizes: list[int],
                rows: int, per_replica: list[tuple[tuple, dict]]) -> None:
    """The losses the replicas' forwards added (``add_loss``, activity regularizers), combined
    as one device's (``added_losses``: a mean weighted by each replica's share of the global
    batch, a sum as it is), summed over every replica and worker, added to ``model``
    (differentiably)."""
    extended = strategy.extended
    counts = sorted({len(c.losses) for c in collected})
    # -1: this worker's replicas disagree. Exchanged before anyone raises, so that every
    # worker raises, rather than the others waiting for this one's gather until its timeout.
    count = counts[0] if len(counts) == 1 else -1
    every = [count]
    if extended.num_workers_in_sync > 1:  # every worker adds as many losses
        every = extended.gather_across_workers(torch.tensor([[count]], dtype=torch.int64), 0)[:, 0].tolist()
    if len(set(every)) > 1 or count < 0:
        where = (f"the replicas' forwards on this worker added {counts}" if count < 0 else
                 f"by worker: {every}" if -1 not in every else "the replicas of one worker disagreed")
        raise KerasUnsupportedError(
            f"The forwards of {type(model).__name__} added different numbers of losses ({where}): a loss "
            "added only for some rows (add_loss under a condition on the data) cannot be combined into "
            "one device's. Add the same losses on every batch."
        )
    if count == 0:
        return
    largest = max(range(len(sizes)), key=lambda k: sizes[k])
    probe_args, probe_kwargs = per_replica[largest] if sizes[largest] else ((), {})
    kinds = added_losses.kinds(strategy, keras, model, count, probe_args, probe_kwargs, extended.primary_device)
    local = added_losses.combine(strategy, [c.losses for c in collected], sizes, rows, kinds)
    total = SummedOverWorkers.apply(local, extended) if extended.num_workers_in_sync > 1 else local
    model.add_loss(total)


class SummedOverWorkers(torch.autograd.Function):
    """A loss term summed over the workers; backward passes each worker its own term's
    gradient, times the number of workers (every worker computed the same total, and
    ``gradients.sum_for_step`` takes the mean of the workers' gradients: see ``GatheredRows``)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, extended: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.workers = extended.num_workers_in_sync
        return extended.reduce_across_workers(local.detach())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.workers, None


def _update_states(strategy: Strategy, states: list[Any], collected: list[_Collected],
                   sizes: list[int] | None = None) -> None:
    """Apply what the replicas' forwards assigned to the model's non-trainable variables:
    floating ones get the mean over the replicas (and workers) that changed them
    (``BatchNormalization``'s moving statistics, as TensorFlow's ON_READ MEAN variables), the
    others replica 0's value (a seed generator's state: every replica and worker advanced it
    alike, so no worker needs another's). ``sizes``: each local replica's rows (None: all
    had some)."""
    extended = strategy.extended
    changed = [any(c.values[i] is not None for c in collected) for i in range(len(states))]
    averaged = [i for i, variable in enumerate(states) if variable.value.is_floating_point()]
    if extended.num_workers_in_sync > 1 and averaged:  # every worker averages the same variables
        flags = torch.tensor([1.0 if changed[i] else 0.0 for i in averaged], dtype=torch.float64)
        for i, flag in zip(averaged, extended.reduce_across_workers(flags).tolist(), strict=True):
            changed[i] = flag > 0
    floating: dict[torch.dtype, list[int]] = {}
    for i, variable in enumerate(states):
        if not changed[i]:
            continue
        current = variable.value
        if current.is_floating_point():
            floating.setdefault(current.dtype, []).append(i)
        elif collected[0].values[i] is not None:
            variable.assign(collected[0].values[i])
    # A replica with no rows (a last batch with fewer rows than replicas) computed its
    # statistics over nothing (NaN): it weighs 0 in the mean, which every worker computes as
    # a sum with the weights' sum appended, whatever its own replicas' rows.
    weights = [1.0 if sizes is None or sizes[k] > 0 else 0.0 for k in range(len(collected))]
    with torch.no_grad():
        for indices in floating.values():
            flats = []
            for part, weight in zip(collected, weights, strict=True):
                values = torch.cat([
                    (part.values[i] if part.values[i] is not None else states[i].value).detach().reshape(-1)
                    .to(extended.primary_device) for i in indices])
                weighted = values * weight if weight else torch.zeros_like(values)
                flats.append(torch.cat([weighted, weighted.new_full((1,), weight)]))
            value: Any = PerReplica(flats) if len(flats) > 1 else flats[0]
            total = extended.reduce_to(ReduceOp.SUM, value, extended.primary_device)
            mean = total[:-1] / total[-1]
            offset = 0
            for i in indices:
                variable = states[i]
                n = variable.value.numel()
                variable.assign(mean[offset:offset + n].view(variable.value.shape))
                offset += n


def _on(structure: Any, device: torch.device) -> Any:
    return nest.map_structure(
        lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) and leaf.device != device else leaf,
        structure)


def _concatenate(outputs: tuple[Any, ...], sizes: list[int], device: torch.device, model: Any) -> Any:
    """The local replicas' outputs, concatenated along the batch (differentiably)."""
    def join(*pieces: Any) -> Any:
        if not all(isinstance(p, torch.Tensor) for p in pieces):
            return pieces[0]
        for piece, size in zip(pieces, sizes, strict=True):
            if piece.dim() == 0 or piece.shape[0] != size:
                raise KerasUnsupportedError(
                    f"{type(model).__name__} returned an output of shape {tuple(piece.shape)} for "
                    f"{size} rows of input: under several replicas every output must have the "
                    "batch as its first dimension, so that the replicas' outputs can be joined."
                )
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat([p.to(device) for p in pieces], dim=0)

    return nest.map_structure_up_to(list(outputs), join)


class GatheredRows(torch.autograd.Function):
    """Every worker's rows of an output, in worker order; backward keeps this worker's rows
    of the gradient, times the number of workers W.

    Each worker computes the same loss on the same gathered outputs. Its terms through the
    outputs reach each worker's weights only through that worker's rows; a term computed on
    the weights themselves (a ``kernel_regularizer``'s penalty, a custom ``train_step``'s) reaches
    every worker's weights whole. ``gradients.sum_for_step`` takes the *mean* of the workers'
    gradients: the row terms, scaled by W here, add up to one device's, and the weight terms
    count once (a sum would count them W times)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, extended: Any, start: int, count: int) -> torch.Tensor:  # type: ignore[override]
        ctx.rows = (start, count)
        ctx.workers = extended.num_workers_in_sync
        return extended.gather_across_workers(local, 0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        start, count = ctx.rows
        return grad[start:start + count] * ctx.workers, None, None, None


def gather_rows(extended: Any, local: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """``local`` (this worker's ``count`` rows, starting at ``start`` of the global batch) from
    every worker, differentiable."""
    if not isinstance(local, torch.Tensor):
        return local
    gathered = GatheredRows.apply(local, extended, start, count)
    return gathered
