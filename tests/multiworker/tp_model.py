"""Shared by ``tests/test_tensor_parallel.py`` and its worker script ``tp_job.py``.

A small GPT (token and position embeddings in one module, 2 pre-norm blocks of attention
with separate q/k/v/o projections and a 4x MLP, a final norm, a head), its layout maps
(Megatron's column/row splits; with sequence parallelism; as torch's own plan), its data and
the one-process reference training. No pytest and no ``torch.distributed`` here.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import proc_helpers  # noqa: E402

RESULT_PREFIX = "TPRESULT "
VOCAB, D, HEADS, LAYERS, SEQ = 32, 32, 4, 2, 8
GLOBAL_BATCH = 8
STEPS = 5
SEED = 11
LR = 1e-2
# eps larger than torch's: a near-zero gradient differs in its last bits between a split
# matmul and a whole one, and Adam turns that into a full lr step at eps=1e-8.
EPS = 1e-4


class Embeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(SEQ, D)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D, bias=False), nn.Linear(D, D)
        self.o = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: the heads this worker holds (all of them, or its share when split).
        q, k, v = (f(x).view(b, t, -1, D // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(D), Attention(), nn.LayerNorm(D), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = Embeddings()
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def layouts(kind: str = "megatron") -> dict[str, Any]:
    """The layout map's entries: ``megatron`` (per-dimension layouts), ``sequence`` (with
    sequence parallelism), ``torch`` (torch's own parallelize_module plan)."""
    if kind == "torch":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"blocks.*.attn.q": ColwiseParallel(), "blocks.*.attn.k": ColwiseParallel(),
                "blocks.*.attn.v": ColwiseParallel(), "blocks.*.attn.o": RowwiseParallel(),
                "blocks.*.mlp.up": ColwiseParallel(), "blocks.*.mlp.down": RowwiseParallel()}
    entries: dict[str, Any] = {
        r"attn\.(q|k|v)\.weight": ("model", None),
        r"attn\.o\.weight": (None, "model"),
        r"mlp\.up\.weight": ("model", None),
        r"mlp\.down\.weight": (None, "model"),
        r"head\.weight": ("model", None),
    }
    if kind == "sequence":
        entries[r"(embed|ln1|ln2|norm)\.output"] = ("data", "model", None)
    return entries


def make_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One global batch: tokens and their next-token targets (a fixed rule to learn)."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator)
    return x, (3 * x + 1) % VOCAB


def per_example_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x).float()
    per_token = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="none")
    return per_token.reshape(x.shape[0], SEQ).mean(dim=1)


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=0.01)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([full(p.detach()).float().reshape(-1).cpu() for p in model.parameters()])


def train(strategy: Any = None, steps: int = STEPS, model: nn.Module | None = None,
          optimizer: torch.optim.Optimizer | None = None, first_step: int = 0) -> dict:
    """Train the GPT (``strategy`` None: one process) on the global batches ``first_step``..."""
    import torch_distribute as td

    if model is None:
        torch.manual_seed(SEED)
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            model = GPT()
            optimizer = make_optimizer(model.parameters())
    assert optimizer is not None
    init = flat(model)
    losses = []
    for step in range(first_step, first_step + steps):
        x, y = make_data(step)
        if strategy is None:
            loss = per_example_loss(model, x, y).sum() / GLOBAL_BATCH
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            continue

        def replica_step(batch: Any) -> torch.Tensor:
            per_example = per_example_loss(model, *batch)
            loss = td.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
        losses.append(float(strategy.reduce(td.ReduceOp.SUM, strategy.run(replica_step, args=(batch,)), axis=None)))
    return {"init": init, "params": flat(model), "losses": losses, "model": model, "optimizer": optimizer}


def parse_results(text: str) -> dict[int, dict]:
    return proc_helpers.parse_results(text, RESULT_PREFIX)
