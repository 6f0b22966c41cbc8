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

# The in-process strategies these tests compare with one device.
STRATEGIES = {
    "one": lambda: td.OneDeviceStrategy("cpu"),
    "mirrored2": lambda: td.MirroredStrategy(["cpu:0", "cpu:1"]),
    "mirrored3": lambda: td.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]),
    "central2": lambda: td.CentralStorageStrategy(["cpu:0", "cpu:1"]),
    "mwms1": lambda: td.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"]),
}


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
    """The step as PyTorch documents it, with the loss over the global batch; without a
    scaler (``None``), a plain float32 step that clips gradients by norm then by value."""
    x, y = batch
    loss = td.compute_average_loss(((model(x) - y) ** 2).squeeze(1), global_batch_size=GLOBAL_BATCH)
    if scaler is None:
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            torch.nn.utils.clip_grad_value_(model.parameters(), clip / 4)
        optimizer.step()
        optimizer.zero_grad()
        return loss
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
