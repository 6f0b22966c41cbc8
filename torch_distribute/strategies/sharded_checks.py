"""The fingerprints of fully sharded steps: each sharded forward and each optimizer step is
agreed between the workers before it runs.

FSDP2 makes its collectives inside the module's forward and backward (a parameter
all-gather per sharded module, a gradient reduce-scatter), where no fingerprint of ours can
ride along. A worker that runs one more forward than the others, or a ``reduce`` the others
do not, would pair those collectives with something else: Gloo aborts the process on the
size mismatch, or the gathers mix unrelated shards. And a worker that skips
``optimizer.step()`` leaves its shard of the parameters behind while the others move theirs,
which no collective notices at all.

So before a sharded root module's forward (ahead of FSDP2's own pre-forward hook, and so of
every gather of that forward and backward), before each step of an optimizer made in the
scope, and before loss scaling's inf/NaN check or gradient clipping (each reduces over the
shards: DTensor all-reduces the found-inf flag, and the norm), the workers exchange a
fingerprint (``WorkerGroup.agree``) naming it and counting it.
A difference raises ``ReplicaMismatchError`` on every worker, naming what each called,
before any collective is paired with the wrong one. That is one exchange per forward of a
sharded model and one per optimizer step (two per plain training step); none with
``CommunicationOptions(verify_collectives=False)`` or a single worker.

Example (what a skipped step on worker 1 is reported as)::

    ReplicaMismatchError: ... worker 0: optimizer step 4 of optimizer 0 (SGD) at train.py:31 in
    step; worker 1: forward 5 of sharded module 0 (Net: its parameters' all-gathers) at
    train.py:28 in step ...
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch import nn

from torch_distribute.collectives.worker_group import WorkerGroup
from torch_distribute.eager import never_compiled


class ShardedStepChecks:
    """Agrees every forward of the watched roots, and every step of the watched optimizers and
    every loss-scaling check or clipping of their gradients."""

    def __init__(self, group: WorkerGroup):
        self._group = group
        self._roots = 0
        self._optimizer_count = 0
        # Each watched optimizer: (its index, its class name, how often its gradients were
        # checked or clipped).
        self._optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, str, Any]] = (
            weakref.WeakKeyDictionary())

    def watch_root(self, root: nn.Module, name: str) -> None:
        """Agree before each forward of ``root`` (a module ``fully_shard`` was applied to;
        ``name``: its class's name before, as the user knows it)."""
        index = self._roots
        self._roots += 1
        forwards = itertools.count(1)

        @never_compiled
        def before_forward(_module: nn.Module, _args: Any) -> None:
            self._group.agree("fully sharded forward", f"forward {next(forwards)} of sharded module "
                                                       f"{index} ({name}: its parameters' all-gathers)")

        # Prepended after fully_shard: runs before FSDP2's pre-forward hook and its gathers.
        root.register_forward_pre_hook(before_forward, prepend=True)

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Agree before each ``optimizer.step()``."""
        index, name = self._optimizer_count, type(optimizer).__name__
        self._optimizer_count += 1
        self._optimizers[optimizer] = (index, name, itertools.count(1))
        steps = itertools.count(1)

        @never_compiled
        def before_step(_optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
            self._group.agree("optimizer step", f"optimizer step {next(steps)} of optimizer {index} ({name})")

        optimizer.register_step_pre_hook(before_step)

    def before_global_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Agree before loss scaling or clipping reads ``optimizer``'s gradients over the shards
        (``GradScaler.unscale_``/``step``, ``clip_grad_norm_``: a collective of their own)."""
        index, name, uses = self._optimizers.get(optimizer, ("?", type(optimizer).__name__, itertools.count(1)))
        self._group.agree("global gradients", f"loss scaling or clipping {next(uses)} of optimizer {index} "
                                              f"({name}: its gradients' reduction over the shards)")
