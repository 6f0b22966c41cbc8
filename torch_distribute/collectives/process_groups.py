"""``ProcessGroups``: the ``torch.distributed`` groups a ``WorkerGroup`` runs its collectives
on, and their release."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist


@dataclass
class ProcessGroups:
    """``main`` carries every collective but the gradient buckets (and every fingerprint
    exchange); ``gradient`` carries the buckets, so they never interleave with the others.
    ``uses_nccl``: CUDA tensors travel on NCCL (else through host memory on Gloo).
    ``adopted``: made over a process group someone else initialized, which is theirs to
    destroy. ``release()`` destroys ours; both groups are None after it.

    >>> groups = ProcessGroups(main=None, gradient=None, uses_nccl=False, adopted=False)
    >>> groups.release()
    """

    main: dist.ProcessGroup | None
    gradient: dist.ProcessGroup | None
    uses_nccl: bool
    adopted: bool

    def release(self) -> None:
        """Destroy our groups (the default one too unless adopted)."""
        # No reference of ours may keep a process group alive past destroy_process_group: its
        # connections must close now (peers learn at once that this worker left) and its C++
        # threads must not outlive the interpreter's teardown.
        own_groups = (self.main, self.gradient)
        self.main = self.gradient = None
        if self.adopted:
            _destroy_groups(own_groups)  # the adopted group is its maker's to destroy
        elif dist.is_initialized():
            dist.destroy_process_group()
        del own_groups


def _destroy_groups(groups: Sequence[dist.ProcessGroup | None]) -> None:
    """Destroy the groups this module made over an adopted group (never the default group)."""
    for group in groups:
        if group is not None and group is not dist.group.WORLD and dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - best effort: the group may be broken already
                pass
