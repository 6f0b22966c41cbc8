"""Shared by ``tests/test_mixed_precision.py`` and its worker ``amp_scaler.py``: the model,
the data (with a non-finite value injected at one step) and the step with a GradScaler."""

from __future__ import annotations

import torch

import torch_distribute as td

GLOBAL_BATCH = 16
STEPS = 12
INJECT_STEP = 5
INIT_SCALE = 2.0**10
GROWTH_INTERVAL = 3


def make_data(inject_row: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches; with ``inject_row``, that row of batch ``INJECT_STEP`` holds an inf."""
    generator = torch.Generator().manual_seed(3)
    data = [(torch.randn(GLOBAL_BATCH, 8, generator=generator), torch.randn(GLOBAL_BATCH, 1, generator=generator))
            for _ in range(STEPS)]
    if inject_row is not None:
        x, y = data[INJECT_STEP]
        x = x.clone()
        x[inject_row, 0] = float("inf")
        data[INJECT_STEP] = (x, y)
    return data


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def make_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)


def step(model, optimizer, scaler, batch, clip: float | None = None) -> torch.Tensor:
    """The step as PyTorch documents it, with the loss over the global batch."""
    x, y = batch
    loss = td.compute_average_loss(((model(x) - y) ** 2).squeeze(1), global_batch_size=GLOBAL_BATCH)
    scaler.scale(loss).backward()
    if clip is not None:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
