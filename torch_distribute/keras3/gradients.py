"""A Keras optimizer's gradients, summed over every replica and worker before it applies them.

Two ways a Keras optimizer is reached with one replica's gradients, and one rule for both:
the optimizer applies, once, the gradient summed over every replica of every worker (as
``tf.keras``' optimizers do under ``tf.distribute``: ``apply_gradients`` in a replica context
is a ``merge_call`` that sums, then updates every copy).

- ``fit``/``train_on_batch`` (``sum_for_step``): the loss was computed once, on the global
  batch's outputs; backward left each replica's share of the gradient in its copy of each
  variable (``strategy.extended.local_copies``) and each worker's share, times the number of
  workers, on that worker, with the terms computed on the weights themselves (a
  regularizer's) whole on every worker. The sum over the local replicas, averaged over the
  workers, is the gradient one device computes.
- ``optimizer.apply(grads, variables)`` inside ``strategy.run`` (a custom training loop,
  ``apply_in_replica``): each replica gives its own gradients, for a loss scaled by the
  global batch (``td.compute_average_loss``); they are summed in a ``merge_call``, applied
  once to the variables, and every replica's copy is refreshed.

The gradients travel packed, one flat buffer per dtype with one "had a gradient" flag per
variable (a variable without a gradient on every replica and worker stays without one, as
one device would leave it), and are reduced with ``strategy.extended.reduce_to``: the local
replicas first, then across workers.

>>> import torch
>>> flat = pack_gradients([torch.ones(2), None], [torch.zeros(2), torch.zeros(3)])
>>> flat.tolist()
[1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
>>> [g if g is None else g.tolist() for g in unpack_gradients(flat, [torch.zeros(2), torch.zeros(3)])]
[[1.0, 1.0], None]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from torch_distribute import context
from torch_distribute.errors import KerasUnsupportedError, UnmirroredStateError
from torch_distribute.reduce_op import ReduceOp
from torch_distribute.values import PerReplica

if TYPE_CHECKING:
    from torch_distribute.strategies import Strategy


def pack_gradients(grads: Sequence[torch.Tensor | None], templates: Sequence[torch.Tensor]) -> torch.Tensor:
    """``grads`` (``None`` for none) in one flat tensor shaped after ``templates`` (the
    variables), followed by one flag per variable: 1 where it had a gradient."""
    pieces, flags = [], []
    for grad, template in zip(grads, templates, strict=True):
        if grad is None:
            pieces.append(torch.zeros(template.numel(), dtype=template.dtype, device=template.device))
        else:
            pieces.append(grad.detach().reshape(-1).to(template.dtype))
        flags.append(0.0 if grad is None else 1.0)
    device = templates[0].device
    pieces.append(torch.tensor(flags, dtype=templates[0].dtype, device=device))
    return torch.cat([p.to(device) for p in pieces])


def unpack_gradients(flat: torch.Tensor, templates: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """The inverse of ``pack_gradients`` (on the sum: a variable keeps ``None`` only where no
    replica or worker had a gradient for it)."""
    out: list[torch.Tensor | None] = []
    offset = 0
    flags = flat[-len(templates):].tolist()
    for template, had in zip(templates, flags, strict=True):
        n = template.numel()
        out.append(flat[offset:offset + n].view(template.shape) if had > 0 else None)
        offset += n
    return out


def _sum_packed(strategy: Strategy, per_replica: list[list[torch.Tensor | None]],
                templates: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Each replica's gradient list (local replica order) summed over every replica and
    worker, one reduction per dtype."""
    extended = strategy.extended
    summed: list[torch.Tensor | None] = [None] * len(templates)
    groups: dict[torch.dtype, list[int]] = {}
    for i, template in enumerate(templates):
        groups.setdefault(template.dtype, []).append(i)
    for indices in groups.values():
        group_templates = [templates[i] for i in indices]
        flats = [pack_gradients([grads[i] for i in indices], group_templates) for grads in per_replica]
        value: Any = PerReplica(flats) if len(flats) > 1 else flats[0]
        total = extended.reduce_to(ReduceOp.SUM, value, extended.primary_device)
        for i, grad in zip(indices, unpack_gradients(total, group_templates), strict=True):
            summed[i] = grad
    return summed


def primary_tensor(variable: Any) -> torch.Tensor:
    """The torch tensor a Keras variable holds (``variable.value``), or the tensor itself."""
    value = getattr(variable, "value", variable)
    if not isinstance(value, torch.Tensor):
        raise KerasUnsupportedError(
            f"optimizer.apply was given {type(variable).__name__}, not a Keras variable or a torch "
            "tensor, under a strategy with several replicas."
        )
    return value


def sum_for_step(strategy: Strategy, grads: Sequence[torch.Tensor | None],
                 variables: Sequence[Any]) -> list[torch.Tensor | None]:
    """The gradients of a ``fit`` step, summed over every local replica and averaged over the
    workers (each worker's gradient is for the same loss: ``forward.GatheredRows``).

    ``grads`` are what Keras read after ``loss.backward()``: each variable's own ``.grad``
    (replica 0's share); the other replicas' shares are in their copies, which are cleared.
    The result is also written into each variable's ``.grad``.
    """
    extended = strategy.extended
    primaries = [primary_tensor(v) for v in variables]
    per_replica: list[list[torch.Tensor | None]] = [[] for _ in range(extended.num_local_replicas)]
    copies_of = []
    for variable, primary, given in zip(variables, primaries, grads, strict=True):
        found = extended.local_copies(primary)
        copies = [c for c in found if isinstance(c, torch.Tensor)] if found is not None else None
        if copies is None:
            raise UnmirroredStateError(
                f"The Keras variable {getattr(variable, 'path', '?')!r} was not created inside "
                f"{type(strategy).__name__}.scope(), so its replicas' gradients cannot be summed. "
                "Build the model (and its layers' weights: give the first layer an input shape, "
                "or call model.build) inside `with strategy.scope():`."
            )
        if len(copies) > 1 and given is not None and given is not primary.grad:
            raise KerasUnsupportedError(
                f"The gradient given to optimizer.apply for {getattr(variable, 'path', '?')!r} is "
                "not the variable's .grad: a train_step that changes the gradients between "
                "loss.backward() and optimizer.apply would change only replica 0's share of them "
                f"under {len(copies)} replicas in one process. Use the optimizer's own `clipnorm`, "
                "`global_clipnorm` or `clipvalue` (applied to the summed gradient), or a "
                "strategy with one replica per process (MultiWorkerMirroredStrategy)."
            )
        copies_of.append(copies)
        for k, replica_copy in enumerate(copies):
            per_replica[k].append(given if replica_copy is primary else replica_copy.grad)
    summed = _sum_packed(strategy, per_replica, primaries)
    workers = extended.num_workers_in_sync
    with torch.no_grad():
        if workers > 1:  # the mean over the workers (see forward.GatheredRows)
            summed = [None if total is None else total.div_(workers) for total in summed]
        for primary, copies, total in zip(primaries, copies_of, summed, strict=True):
            for replica_copy in copies:
                if replica_copy is not primary:
                    replica_copy.grad = None  # its share is in the sum now
            if total is None:
                continue
            if primary.grad is not None and primary.grad.shape == total.shape:
                primary.grad.copy_(total)
                total = primary.grad
            else:
                primary.grad = total.to(primary.device)
    return [None if t is None else p.grad for p, t in zip(primaries, summed, strict=True)]


def apply_in_replica(replica: context.ReplicaContextLike, apply: Callable[[list[Any], list[Any]], Any],
                     grads: Sequence[torch.Tensor | None], variables: Sequence[Any]) -> Any:
    """``apply(summed_grads, variables)`` once for every replica of every worker, from inside
    ``strategy.run``; every replica's copy of the variables holds the result afterwards."""
    variables = list(variables)
    templates = [primary_tensor(v) for v in variables]
    mine = _Gradients([None if g is None else g.detach() for g in grads])

    def merge(strategy: Strategy, per_replica: Any) -> Any:
        extended = strategy.extended
        if not extended.keeps_captured_tensors:
            raise KerasUnsupportedError(
                f"A Keras optimizer's apply() inside {type(strategy).__name__}.run(): this strategy "
                "replaces the parameters it captures (sharded or remote ones), which a Keras "
                "optimizer, holding Keras variables, would never update. Use MirroredStrategy, "
                "MultiWorkerMirroredStrategy, CentralStorageStrategy or OneDeviceStrategy."
            )
        parts = per_replica.values if isinstance(per_replica, PerReplica) else (per_replica,)
        summed = _sum_packed(strategy, [part.grads for part in parts], templates)
        result = apply(summed, variables)
        for template in templates:
            extended.local_copies(template)  # every replica computes with the new values
        return result

    return replica.merge_call(merge, args=(mine,))


class _Gradients:
    """One replica's gradients, carried through ``merge_call`` as one value (a leaf)."""

    __slots__ = ("grads",)

    def __init__(self, grads: list[torch.Tensor | None]):
        self.grads = grads
