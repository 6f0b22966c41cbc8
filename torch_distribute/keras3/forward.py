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

Variables a training forward changes (``BatchNormalization``'s moving statistics) are
averaged over the replicas and workers that changed them, as TensorFlow's ON_READ MEAN
variables are.

>>> row_ranges(7, num_workers=2, num_local_replicas=2, worker_index=1)
(4, [2, 1])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torch_distribute import context, nest
from torch_distribute.errors import KerasUnsupportedError
from torch_distribute.input.batching import batch_sizes_for_worker
from torch_distribute.reduce_op import ReduceOp
from torch_distribute.values import PerReplica, select_replica


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


def spread(strategy: context.StrategyLike, keras_device: Callable[[str], Any], model: Any,
           args: tuple, kwargs: dict, training: bool) -> Any:
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

    states = _ChangedStates(strategy, model) if training else None

    def replica_forward(inputs: tuple[tuple, dict]) -> Any:
        replica_args, replica_kwargs = inputs
        local_id = context.get_replica_context().local_replica_id
        device = devices[local_id]
        with keras_device(str(device)):
            out = model(*_on(replica_args, device), **_on(replica_kwargs, device))
        return out, (states.read() if states is not None else None)

    value: Any = PerReplica(per_replica) if len(per_replica) > 1 else per_replica[0]
    result = strategy.run(replica_forward, args=(value,))
    results = [select_replica(k, result) for k in range(len(per_replica))]
    outputs = tuple(r[0] for r in results)
    if states is not None:
        states.average([r[1] for r in results])
    local = _concatenate(outputs, local_sizes, extended.primary_device, model)
    if extended.num_workers_in_sync == 1:
        return local
    return nest.map_structure(lambda t: gather_rows(extended, t, start, local_rows), local)


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
    of the gradient (each worker computed the same loss on the same gathered outputs)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, extended: Any, start: int, count: int) -> torch.Tensor:  # type: ignore[override]
        ctx.rows = (start, count)
        return extended.gather_across_workers(local, 0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        start, count = ctx.rows
        return grad[start:start + count], None, None, None


def gather_rows(extended: Any, local: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """``local`` (this worker's ``count`` rows, starting at ``start`` of the global batch) from
    every worker, differentiable."""
    if not isinstance(local, torch.Tensor):
        return local
    gathered = GatheredRows.apply(local, extended, start, count)
    return gathered


class _ChangedStates:
    """The model's floating non-trainable variables around a training forward: those a replica
    changed (``BatchNormalization``'s moving statistics) are averaged over every replica and
    worker, as TensorFlow's ON_READ MEAN variables are; the others are left alone."""

    def __init__(self, strategy: context.StrategyLike, model: Any):
        self._strategy = strategy
        self._tensors = [v.value for v in model.non_trainable_variables
                         if isinstance(getattr(v, "value", None), torch.Tensor) and v.value.is_floating_point()]
        self._before = [t.detach().clone() for t in self._tensors]

    def read(self) -> list[torch.Tensor] | None:
        """Inside a replica: its values (its copies', which the replica's torch calls read)."""
        if not self._tensors:
            return None
        return [t.detach().clone() for t in self._tensors]

    def average(self, per_replica: list[list[torch.Tensor] | None]) -> None:
        """After the run: every changed variable gets the mean of the replicas' values."""
        if not self._tensors:
            return
        values = [v for v in per_replica if v is not None]
        extended = self._strategy.extended
        changed = [any(not torch.equal(v[i].to(b.device), b) for v in values)
                   for i, b in enumerate(self._before)]
        if extended.num_workers_in_sync > 1:  # every worker averages the same variables
            flags = torch.tensor([1.0 if c else 0.0 for c in changed], dtype=torch.float64)
            changed = [f > 0 for f in extended.reduce_across_workers(flags).tolist()]
        chosen = [i for i, c in enumerate(changed) if c]
        if not chosen:
            return
        groups: dict[torch.dtype, list[int]] = {}
        for i in chosen:
            groups.setdefault(self._tensors[i].dtype, []).append(i)
        with torch.no_grad():
            for indices in groups.values():
                flats = [torch.cat([v[i].reshape(-1).to(extended.primary_device) for i in indices]) for v in values]
                value: Any = PerReplica(flats) if len(flats) > 1 else flats[0]
                mean = extended.reduce_to(ReduceOp.MEAN, value, extended.primary_device)
                offset = 0
                for i in indices:
                    tensor = self._tensors[i]
                    tensor.copy_(mean[offset:offset + tensor.numel()].view(tensor.shape))
                    offset += tensor.numel()
