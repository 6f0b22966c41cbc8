"""Refusing a loss averaged over one replica's batch (the DDP habit) before it is applied.

Gradients are SUMMED across replicas (``losses.py``), so each replica's loss must be its
share of the mean over the *global* batch. DDP averages gradients instead, so DDP code writes
``F.cross_entropy(logits, y)`` (``reduction="mean"``): under N replicas that update is N
times the one-device update, silently. At every ``backward()`` inside ``strategy.run`` with
more than one replica in sync, the top of the loss's autograd graph is inspected (the graph
already exists; nothing is recomputed) and such a loss raises ``LossScalingError``, before any
gradient is computed.

What is detected: walking down from the loss through the arithmetic that combines loss terms
(``+``, ``-``, multiplication by a number, division by a number, casts, views, sums), a node
that averages over dimension 0 of a tensor whose first dimension is this replica's batch
size (the first dimension of a tensor given to ``strategy.run``, or the product of its first
two, for ``(batch, time)`` flattened): ``Tensor.mean()`` / ``torch.mean`` over all dimensions
or over dimension 0, and torch's native losses with ``reduction="mean"``
(``cross_entropy``/``nll_loss``, ``mse_loss``, ``binary_cross_entropy[_with_logits]``,
``smooth_l1_loss``, ``huber_loss``, margin losses); the composite ones (``l1_loss``,
``kl_div``, ...) end in a mean and are caught as one. A Keras 3 loss with its default
reduction (``"sum_over_batch_size"``) on the torch backend, whose graph is
``where(count == 0, 0, sum / count)`` with ``count`` the summed tensor's size, is caught as one
too (torch code does not wrap its division in a ``where``).

Why there are no false positives on correct code:

- ``td.compute_average_loss`` (and ``fit``) sum and divide: no mean node; a mean over other
  dimensions (per-example ``.mean(dim=-1)`` before ``compute_average_loss``) does not reduce
  dimension 0.
- A mean divided by ``num_replicas_in_sync`` on the way to the loss (or by a multiple of it,
  in one division or several: ``/ (N * accumulation_steps)``), or multiplied by exactly
  ``1 / N``, is accepted: with equal replica batches that is the one-device scale.
- The walk stops at anything it cannot read: a division by a GPU tensor (say, a token count),
  a product with a non-scalar tensor, any model operation. A multiplication by a GPU scalar
  (``GradScaler.scale``) is read as a weight.
- ``backward(gradient=...)`` and functions given no tensor are not checked (the scale or the
  batch size is unknown); ``torch.autograd.grad`` is not intercepted.

Limits (not detected): a mean written by hand (``loss.sum() / len(x)``), time-major batches
(``(time, batch)``, mean over dimension 1), a loss built inside ``torch.compile`` (its graph is
one compiled node), a mean divided by an unrelated number that happens to be a multiple of the
replica count (``mean / 10`` with 2 replicas), or multiplied by ``1 / N`` for another reason.

Turned off for every strategy with ``td.config.set_loss_scaling_check(False)``, or for one with
``strategy.set_loss_scaling_check(False)``.

>>> import torch, torch.nn.functional as F
>>> logits = torch.randn(4, 3, requires_grad=True)
>>> describe_local_mean(F.cross_entropy(logits, torch.tensor([0, 1, 2, 0])), 2, {4})
'F.cross_entropy / F.nll_loss (nn.CrossEntropyLoss, nn.NLLLoss) with reduction="mean"'
>>> per_example = F.cross_entropy(logits, torch.tensor([0, 1, 2, 0]), reduction="none")
>>> describe_local_mean(per_example.sum() / 8, 2, {4}) is None
True
>>> describe_local_mean(F.cross_entropy(logits, torch.tensor([0, 1, 2, 0])) / 2, 2, {4}) is None
True
"""

from __future__ import annotations

import contextvars
import functools
import re
from collections.abc import Callable, Container
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from torch_distribute import nest
from torch_distribute.errors import LossScalingError

if TYPE_CHECKING:
    from torch_distribute.context import StrategyLike

#: The inputs of the replica function running on this thread, while it runs.
_replica_inputs: contextvars.ContextVar[tuple[tuple, dict] | None] = contextvars.ContextVar(
    "td_replica_inputs", default=None)

# Nodes that pass a loss term through unchanged in scale (or by a scale read separately).
_PASS_THROUGH = frozenset({
    "AddBackward0", "SubBackward0", "NegBackward0", "ToCopyBackward0", "CloneBackward0",
    "AliasBackward0", "ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0",
    "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "UnsqueezeBackward0",
    "SumBackward0", "SumBackward1", "StackBackward0", "CatBackward0",
})
_MEANS = frozenset({"MeanBackward0", "MeanBackward1"})
#: ``_saved_reduction`` of torch's native losses: 0 none, 1 mean, 2 sum.
_REDUCTION_MEAN = 1
#: At most this many nodes are looked at per loss (the arithmetic that combines its terms).
_MAX_NODES = 256
_NAMES = {
    "NllLoss": 'F.cross_entropy / F.nll_loss (nn.CrossEntropyLoss, nn.NLLLoss) with reduction="mean"',
    "NllLoss2D": 'F.cross_entropy / F.nll_loss (nn.CrossEntropyLoss, nn.NLLLoss) with reduction="mean"',
}


def with_replica_inputs(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, remembering its arguments while it runs (their first dimensions are the
    replica's batch size that ``check_backward`` looks for)."""

    @functools.wraps(fn)
    def remembering(*args: Any, **kwargs: Any) -> Any:
        token = _replica_inputs.set((args, kwargs))
        try:
            return fn(*args, **kwargs)
        finally:
            _replica_inputs.reset(token)

    return remembering


def batch_sizes(inputs: Any) -> set[int]:
    """The sizes a batch dimension can have: each input tensor's first dimension, and the
    product of its first two (``(batch, time)`` flattened into rows).

    >>> sorted(batch_sizes(((torch.zeros(4, 8), torch.zeros(4)), {})))
    [4, 32]
    """
    sizes: set[int] = set()
    for leaf in nest.leaves(inputs):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            sizes.add(int(leaf.shape[0]))
            if leaf.dim() >= 2:
                sizes.add(int(leaf.shape[0]) * int(leaf.shape[1]))
    return sizes


def check_backward(strategy: StrategyLike, num_replicas: int, tensors: Any, grad_tensors: Any) -> None:
    """Raise ``LossScalingError`` if a loss given to ``backward`` inside ``strategy.run`` is
    averaged over this replica's batch (see the module docstring). Called by the
    ``torch.autograd.backward`` wrapper in ``interception.py``."""
    if num_replicas <= 1 or not strategy.loss_scaling_check:
        return
    if grad_tensors is not None and any(g is not None for g in _as_tuple(grad_tensors)):
        return  # the caller chose the scale
    inputs = _replica_inputs.get()
    if inputs is None:
        return
    sizes = _LazySizes(inputs)  # read only if a mean is found: correct losses never pay for it
    for loss in _as_tuple(tensors):
        if not isinstance(loss, torch.Tensor) or loss.grad_fn is None or loss.numel() != 1:
            continue
        found = describe_local_mean(loss, num_replicas, sizes)
        if found is not None:
            raise LossScalingError(_message(found, num_replicas))


class _LazySizes:
    """``batch_sizes(inputs)``, computed on the first ``in``."""

    def __init__(self, inputs: Any):
        self._inputs = inputs
        self._sizes: set[int] | None = None

    def __contains__(self, size: object) -> bool:
        if self._sizes is None:
            self._sizes = batch_sizes(self._inputs)
        return size in self._sizes


def describe_local_mean(loss: torch.Tensor, num_replicas: int, sizes: Container[int]) -> str | None:
    """What averages ``loss`` over a batch of one of ``sizes`` without a division by
    ``num_replicas`` on the way, or ``None``."""
    # (node, whether the path from the loss divides by the replicas, the numbers it divided by)
    stack: list[tuple[Any, bool, float]] = [(loss.grad_fn, False, 1.0)]
    seen = 0
    while stack and seen < _MAX_NODES:
        node, shared, divisor = stack.pop()
        seen += 1
        name = type(node).__name__
        if name in _MEANS:
            if not shared and _mean_over_batch(node, sizes):
                return "Tensor.mean() (or torch.mean, or a loss with reduction=\"mean\" such as F.l1_loss)"
            continue
        if name == "WhereBackward0" and not shared and _keras_mean_over_batch(node, sizes):
            return 'a Keras loss with reduction="sum_over_batch_size" (its default)'
        reduction = getattr(node, "_saved_reduction", None)
        if reduction is not None:
            if not shared and reduction == _REDUCTION_MEAN and _first_dim(getattr(node, "_saved_self", None)) in sizes:
                return _loss_name(name)
            continue
        stack.extend(_inputs_with_scale(node, name, shared, divisor, num_replicas))
    return None


def _inputs_with_scale(node: Any, name: str, shared: bool, divisor: float,
                       num_replicas: int) -> list[tuple[Any, bool, float]]:
    """The inputs of ``node`` to walk on to, each with whether the path now divides by the
    replicas: a division by them (or by a multiple: ``/ (N * accumulation_steps)``, or
    ``/ accumulation_steps / N``), or a multiplication by exactly ``1 / N``."""
    inputs = [(k, fn) for k, (fn, _) in enumerate(node.next_functions) if fn is not None]
    if name in _PASS_THROUGH or name == "WhereBackward0":  # where(): each element of one input
        return [(fn, shared, divisor) for _, fn in inputs]
    if name == "MulBackward0":
        out = []
        for k, fn in inputs:
            factor = _scalar(getattr(node, "_saved_other" if k == 0 else "_saved_self", None))
            if factor is _UNREADABLE:
                continue
            by_one_over_n = factor is not None and abs(factor * num_replicas - 1.0) <= 1e-6
            out.append((fn, shared or by_one_over_n, divisor))
        return out
    if name == "DivBackward0":
        by = _scalar(getattr(node, "_saved_other", None))
        if by is _UNREADABLE or by is None:
            return []  # a tensor on a device, or not a scalar: its value is unknown
        divisor *= abs(by)
        return [(fn, shared or _is_multiple(divisor, num_replicas), divisor) for k, fn in inputs if k == 0]
    return []


_UNREADABLE = object()


def _scalar(value: Any) -> Any:
    """A one-element factor's value; ``None`` for one on a GPU (not read: that would wait for
    the device); ``_UNREADABLE`` for anything else."""
    if isinstance(value, (int, float)):
        return float(value)
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        return _UNREADABLE
    if value.device.type != "cpu":
        return None
    return float(value.item())


def _is_multiple(divisor: float, num_replicas: int) -> bool:
    """Whether ``divisor`` is a positive whole multiple of the replica count."""
    ratio = divisor / num_replicas
    return ratio >= 1 - 1e-6 and abs(ratio - round(ratio)) <= 1e-6 * ratio


def _mean_over_batch(node: Any, sizes: Container[int]) -> bool:
    shape = tuple(getattr(node, "_saved_self_sym_sizes", ()))
    if not shape or int(shape[0]) not in sizes:
        return False
    dims = getattr(node, "_saved_dim", None)
    if not dims:  # MeanBackward0, or dim=[]: over every dimension
        return True
    return any(_normalized(int(d), len(shape)) == 0 for d in dims)


def _keras_mean_over_batch(node: Any, sizes: Container[int]) -> bool:
    """``where(count == 0, 0, t.sum() / count)`` (Keras' ``divide_no_nan`` on torch) with ``t``
    a tensor of a replica's batch size rows and ``count`` its number of elements: a mean."""
    for fn, _ in node.next_functions:
        if fn is None or type(fn).__name__ != "DivBackward0":
            continue
        count = _scalar(getattr(fn, "_saved_other", None))
        summed = [inner for inner, _ in fn.next_functions if inner is not None]
        if count is _UNREADABLE or count is None or not summed or type(summed[0]).__name__ != "SumBackward0":
            continue
        shape = tuple(int(d) for d in getattr(summed[0], "_saved_self_sym_sizes", ()))
        if shape and shape[0] in sizes and abs(float(count) - float(np.prod(shape))) < 0.5:
            return True
    return False


def _normalized(dim: int, rank: int) -> int:
    if dim >= 2**63:  # saved as unsigned
        dim -= 2**64
    return dim % rank if rank else dim


def _first_dim(tensor: Any) -> int | None:
    if isinstance(tensor, torch.Tensor) and tensor.dim() >= 1:
        return int(tensor.shape[0])
    return None


def _loss_name(node_name: str) -> str:
    base = node_name.removesuffix("Backward0")
    if base in _NAMES:
        return _NAMES[base]
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", base).lower()
    return f'F.{snake} with reduction="mean"'


def _as_tuple(value: Any) -> tuple[Any, ...]:
    if isinstance(value, (tuple, list)):
        return tuple(value)
    return (value,)


def _message(found: str, num_replicas: int) -> str:
    return (
        f"loss.backward() inside strategy.run() with {num_replicas} replicas in sync: the loss is "
        f"averaged over this replica's batch ({found}). Gradients are summed across replicas "
        f"(not averaged as in DDP), so this update would be {num_replicas}x the one-device update. "
        "Keep one loss per example and divide by the global batch size:\n"
        '    per_example = F.cross_entropy(logits, labels, reduction="none")  # shape (batch,)\n'
        "    loss = td.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH_SIZE)\n"
        "If a per-replica mean is what you want, turn this check off: "
        "td.config.set_loss_scaling_check(False), or strategy.set_loss_scaling_check(False)."
    )
