"""Shared by ``tests/test_fully_sharded.py`` and its worker script ``fs_job.py``.

A tiny transformer (an embedding, 2 ``nn.TransformerEncoderLayer`` blocks in an
``nn.ModuleList``, a linear head), its token data and the one-process reference training
(no strategy, the chief's seed, the same global batches). No pytest and no
``torch.distributed`` here: the worker processes import this module too.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import proc_helpers  # noqa: E402

RESULT_PREFIX = "FSRESULT "
VOCAB = 16
SEQ = 6
D_MODEL = 32
N_SAMPLES = 49  # 6 global batches of 8 and a last one of 1 row: some worker gets 0 rows
GLOBAL_BATCH = 8
LR = 5e-3
EPOCHS = 3
CHIEF_SEED = 1
# fit: 6 global batches of 8 and a last one of 1 row, so fit's last step gives some worker 0 rows.
KERAS_SAMPLES = 49
KERAS_EPOCHS = 2


def worker_seed(rank: int) -> int:
    """Every worker seeds differently: the chief's initial values must win anyway."""
    return 100 * rank + CHIEF_SEED


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        # bias=False: the key projection's bias has an identically zero gradient (softmax
        # ignores a shift shared by every key), and Adam turns its rounding noise into full
        # ``lr`` steps, different for every summation order; no two runs would agree on it.
        self.blocks = nn.ModuleList([
            nn.TransformerEncoderLayer(D_MODEL, nhead=4, dim_feedforward=64, dropout=0.0,
                                       batch_first=True, bias=False)
            for _ in range(2)])
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make_model() -> TinyTransformer:
    return TinyTransformer()


def make_data(n: int = N_SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and next-token targets (a fixed random permutation of the vocabulary)."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=generator)
    perm = torch.randperm(VOCAB, generator=generator)
    return x, perm[x]


def make_loader(x: torch.Tensor, y: torch.Tensor, batch: int = GLOBAL_BATCH) -> torch.utils.data.DataLoader:
    """Global batches, reshuffled every epoch, in the same order in every process."""
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=batch, shuffle=True,
        generator=torch.Generator().manual_seed(3))


def global_batch_sizes(n: int = N_SAMPLES, batch: int = GLOBAL_BATCH) -> list[int]:
    return [min(batch, n - start) for start in range(0, n, batch)]


def per_example_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of each row (shape ``[rows]``; ``[0]`` for an empty shard)."""
    logits = model(tokens).float()
    per_token = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    return per_token.reshape(tokens.shape[0], SEQ).mean(dim=1)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a parameter (a sharded DTensor is gathered)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def flat(model: nn.Module) -> torch.Tensor:
    """Every parameter, whole (gathered), as one float32 vector."""
    return torch.cat([full(p.detach()).float().reshape(-1).cpu() for p in model.parameters()])


def encode(tensor: torch.Tensor) -> str:
    """A float32 tensor as base64 text, exact and compact (the launcher cuts lines at 1 MiB)."""
    return base64.b64encode(tensor.detach().float().contiguous().numpy().tobytes()).decode("ascii")


def decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.float32)


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def train(strategy: Any, epochs: int = EPOCHS, seed: int = CHIEF_SEED,
          wrap_step: Callable[[Callable], Callable] | None = None) -> dict:
    """Train the tiny transformer with ``strategy`` (None: one process, no strategy).

    Per-step global losses, initial and final parameters (whole), the metric of every
    per-example loss; ``wrap_step`` decorates the distributed step (``td.function``).
    Returns the model and optimizer too (under ``"model"``, ``"optimizer"``).
    """
    import torch_distribute as td  # the library only where a strategy is used

    torch.manual_seed(seed)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model = make_model()
        optimizer = make_optimizer(model.parameters())
        metric = td.metrics.Mean() if strategy is not None else None
    init = flat(model)
    x, y = make_data()
    loader = make_loader(x, y)  # one loader: its shuffle order moves on every epoch
    sizes = global_batch_sizes()
    losses: list[float] = []
    if strategy is None:
        total, count = 0.0, 0
        for _ in range(epochs):
            for xb, yb in loader:
                per_example = per_example_loss(model, xb, yb)
                loss = per_example.sum() / xb.shape[0]
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
                total += float(per_example.detach().double().sum())
                count += xb.shape[0]
        metric_value = total / count
        steps_per_epoch = [len(sizes)] * epochs
    else:
        def replica_step(batch, global_batch_size):
            xb, yb = batch
            per_example = per_example_loss(model, xb, yb)
            loss = td.compute_average_loss(per_example, global_batch_size=global_batch_size)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            metric.update_state(per_example.detach())
            return loss

        def distributed_step(batch, global_batch_size):
            per_replica = strategy.run(replica_step, args=(batch, global_batch_size))
            return strategy.reduce(td.ReduceOp.SUM, per_replica, axis=None)

        step = wrap_step(distributed_step) if wrap_step is not None else distributed_step
        dist_ds = strategy.experimental_distribute_dataset(loader)
        steps_per_epoch = []
        for _ in range(epochs):
            steps = 0
            for batch in dist_ds:
                losses.append(float(step(batch, sizes[steps])))
                steps += 1
            steps_per_epoch.append(steps)
        metric_value = float(metric.result())
    return {"init": init, "params": flat(model), "losses": losses, "metric": metric_value,
            "steps_per_epoch": steps_per_epoch, "model": model, "optimizer": optimizer}


def emit(payload: dict) -> None:
    print(RESULT_PREFIX + json.dumps(payload), flush=True)
    sys.stdout.flush()


def parse_results(text: str) -> dict[int, dict]:
    """``{rank: payload}`` from worker output (plain, or prefixed ``[rank i] `` by the launcher)."""
    return proc_helpers.parse_results(text, RESULT_PREFIX)
