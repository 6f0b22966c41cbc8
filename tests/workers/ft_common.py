"""The model, data and one-process replay shared by the fault-tolerant jobs and their test.

No pytest, no torch_distribute: the worker scripts and the test process import this.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

import torch
import torch.nn.functional as F

SEED = 7
ROWS = 240
GLOBAL_BATCH = 12  # 20 global batches per pass; 4 rows per worker with 3, 6 with 2
LR = 0.01
GAMMA = 0.99  # the custom loop's learning rate decays every committed step


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def make_loader() -> torch.utils.data.DataLoader:
    """Global batches, reshuffled every pass, in the same order in every process."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(ROWS, 4, generator=generator)
    y = torch.randint(0, 3, (ROWS,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=GLOBAL_BATCH,
                                       shuffle=True, generator=torch.Generator().manual_seed(3))


def digest(state: Any) -> str:
    """SHA-256 of every tensor in ``state`` (a list of tensors or a state dict), bit for bit."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def replay(records: list[dict], fit: bool = False) -> torch.nn.Module:
    """One process, no strategy: train on the global batches the committed steps read, in
    order (``records``: ``td.experimental.read_committed_steps``): from the custom loop's
    dataset ``#0`` (its pass ``p`` is the loader's ``p``-th), or under ``fit`` from
    ``fit/train/<epoch>`` (one pass each: the loader's ``epoch``-th)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny steps: threads only cost on a busy machine
    try:
        return _replay(records, fit)
    finally:
        torch.set_num_threads(threads)


def _position(read: list) -> tuple[int, int] | None:
    key, passes, batch = read
    if key == "#0":
        return passes, batch
    if key.startswith("fit/train/"):
        return int(key.rsplit("/", 1)[1]) + passes, batch
    return None


def _replay(records: list[dict], fit: bool) -> torch.nn.Module:
    torch.manual_seed(SEED)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    schedule = None if fit else torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=GAMMA)
    wanted = [position for record in records for read in record["reads"]
              if (position := _position(read)) is not None and read[0].startswith("fit/") == fit]
    assert len(wanted) == len(records), "one training batch per committed step"
    order = {position: k for k, position in enumerate(wanted)}
    batches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    loader = make_loader()
    if fit:
        iter(loader)  # fit looks once whether its data can be iterated again (drawing a seed)
    for passes in range(1 + max(p for p, _ in wanted)):
        for index, batch in enumerate(loader):
            if (passes, index) in order:
                batches[order[(passes, index)]] = batch
    for k in range(len(wanted)):
        x, y = batches[k]
        (F.cross_entropy(model(x), y, reduction="none").sum() / GLOBAL_BATCH).backward()
        optimizer.step()
        optimizer.zero_grad()
        if schedule is not None:
            schedule.step()
    return model
