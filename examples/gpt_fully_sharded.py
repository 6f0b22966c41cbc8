"""A small GPT (character level) trained with ``FullyShardedStrategy``: FSDP2, one process per worker.

Each worker holds only its shard of the parameters and of the AdamW state (about 1/N of the
model); FSDP2 gathers a block's parameters for its forward and backward and reduce-scatters
the gradients. The training step is the same as for every strategy; only the strategy line
changes (``--strategy multi_worker_mirrored`` trains the same model data-parallel, every
worker holding all of it).

    python -m torch_distribute.launch --nproc 2 examples/gpt_fully_sharded.py
    python -m torch_distribute.launch --nproc 2 examples/gpt_fully_sharded.py --strategy multi_worker_mirrored
    python examples/gpt_fully_sharded.py --steps 50          # no cluster: one local worker

Model: token embedding + learned positions, ``--layers`` pre-LayerNorm blocks in an
``nn.ModuleList`` (causal self-attention with ``F.scaled_dot_product_attention(is_causal=True)``,
then a 4x MLP), a final LayerNorm and an output layer tied to the token embedding. The
strategy's default shard policy gives every block of the ``nn.ModuleList`` its own shard, then
shards the root (embeddings, final
LayerNorm).

Data (no download): the source text of a few Python standard-library modules
(``inspect.getsource`` of ``TEXT_MODULES``; the exact text depends on the Python version),
one character per token. The first 90% is for training, the rest for validation. Every
global batch is ``--global-batch-size`` windows of ``--seq-len + 1`` characters at offsets
drawn from a generator seeded with ``--seed``, so every worker makes the same global batches
and keeps its own rows (``experimental_distribute_dataset``).

The defaults (4 layers, width 128, 64 characters of context, global batch 32, 300 steps) train
in about a minute on 2 CPU cores (~0.12-0.25 s a step), the loss falling from ~4.4 to ~2
(validation ~2.1; a uniform guess over the ~100 characters scores ~4.6). Printed by the chief: the global loss every ``--log-every`` steps and
the validation loss at the end; by every worker: the bytes of its parameters and optimizer
state against the whole model's, and a final ``GPTRESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import torch_distribute as td

TEXT_MODULES = (
    "argparse", "collections", "dataclasses", "functools", "inspect", "json.decoder",
    "pathlib", "random", "textwrap", "typing",
)
VALIDATION_FRACTION = 0.1
RESULT_PREFIX = "GPTRESULT "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["fully_sharded", "multi_worker_mirrored"], default="fully_sharded")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch-size", type=int, default=32, help="windows per step, all workers together")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128, help="model width (heads of 32 channels)")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default: width // 32)")
    parser.add_argument("--seq-len", type=int, default=64, help="characters of context")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--val-batches", type=int, default=8, help="global batches of validation windows")
    return parser.parse_args(argv)


# -- data -------------------------------------------------------------------------------------
def load_text(modules: tuple[str, ...] = TEXT_MODULES) -> str:
    """The source of a few standard-library modules, concatenated (no download)."""
    return "\n".join(inspect.getsource(importlib.import_module(name)) for name in modules)


class CharData:
    """One token per character; ``train``/``val`` token tensors split by position."""

    def __init__(self, text: str, validation_fraction: float = VALIDATION_FRACTION):
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        tokens = torch.tensor([index[c] for c in text], dtype=torch.long)
        cut = int(len(tokens) * (1 - validation_fraction))
        self.train, self.val = tokens[:cut], tokens[cut:]

    @property
    def vocab_size(self) -> int:
        return len(self.chars)


def make_batches(
    tokens: torch.Tensor, num_batches: int, global_batch: int, seq_len: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_batches`` global batches ``(x, y)`` of ``global_batch`` random windows each, ``y``
    being ``x`` shifted by one character; the same in every process for the same ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    span = torch.arange(seq_len + 1)
    batches = []
    for _ in range(num_batches):
        starts = torch.randint(0, len(tokens) - seq_len - 1, (global_batch,), generator=generator)
        windows = tokens[starts[:, None] + span]
        batches.append((windows[:, :-1].contiguous(), windows[:, 1:].contiguous()))
    return batches


# -- model ------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, width: int, layers: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.tok_emb = nn.Embedding(vocab_size, width)
        self.pos_emb = nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: one parameter
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                # GPT-2's initialisation; residual projections scaled down with depth.
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def make_model(vocab_size: int, args: argparse.Namespace) -> GPT:
    return GPT(vocab_size, args.seq_len, args.width, args.layers, args.heads or max(1, args.width // 32))


def per_window_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the characters of each window: one loss per example."""
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1)


# -- memory -----------------------------------------------------------------------------------
def _bytes(tensor: torch.Tensor) -> tuple[int, int]:
    """(bytes this worker holds, bytes of the whole tensor): a DTensor's local shard vs its
    global shape; a plain tensor is held whole."""
    if isinstance(tensor, DTensor):
        return tensor.to_local().numel() * tensor.element_size(), tensor.numel() * tensor.element_size()
    n = tensor.numel() * tensor.element_size()
    return n, n


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Bytes of the parameters and optimizer state: (this worker's, the whole model's)."""
    tensors = list(model.parameters())  # tied weights once
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    local = whole = 0
    for tensor in tensors:
        mine, full = _bytes(tensor)
        local += mine
        whole += full
    return local, whole


def make_strategy(name: str) -> td.Strategy:
    # The cluster comes from the launcher (torchrun's variables), TF_CONFIG or SLURM; with
    # none, one local worker.
    if name == "fully_sharded":
        # The default policy: each block of the ModuleList sharded on its own (gathered only
        # around its own forward and backward), then the root (embeddings, final LayerNorm).
        return td.FullyShardedStrategy()
    return td.MultiWorkerMirroredStrategy()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    data = CharData(load_text())
    strategy = make_strategy(args.strategy)
    rank = strategy.extended.worker_index
    is_chief = strategy.extended.should_checkpoint
    log = print if is_chief else (lambda *_a, **_k: None)
    workers = strategy.num_replicas_in_sync
    if args.global_batch_size % workers:
        raise SystemExit(f"--global-batch-size {args.global_batch_size} is not a multiple of {workers} workers")
    GLOBAL_BATCH = args.global_batch_size
    log(f"{type(strategy).__name__} over {workers} worker(s); text: {len(data.train)} training and "
        f"{len(data.val)} validation characters, vocabulary {data.vocab_size}")

    with strategy.scope():
        model = make_model(data.vocab_size, args)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    log(f"GPT: {args.layers} layers, width {args.width}, context {args.seq_len}, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters")

    train_batches = make_batches(data.train, args.steps, GLOBAL_BATCH, args.seq_len, args.seed)
    val_batches = make_batches(data.val, args.val_batches, GLOBAL_BATCH, args.seq_len, args.seed + 1)

    def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        loss = td.compute_average_loss(per_window_loss(model, x, y), global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def val_step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        with torch.no_grad():
            return td.compute_average_loss(per_window_loss(model, x, y), global_batch_size=GLOBAL_BATCH)

    losses = []
    started = time.perf_counter()
    model.train()
    for step, batch in enumerate(strategy.experimental_distribute_dataset(train_batches), start=1):
        loss = float(strategy.reduce("sum", strategy.run(train_step, args=(batch,)), axis=None))
        losses.append(loss)
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            elapsed = time.perf_counter() - started
            log(f"step {step:4d}  loss {loss:.4f}  ({elapsed:.1f}s, {1e3 * elapsed / step:.0f} ms/step)")
    train_s = time.perf_counter() - started

    model.eval()
    val_total = 0.0
    for batch in strategy.experimental_distribute_dataset(val_batches):
        val_total += float(strategy.reduce("sum", strategy.run(val_step, args=(batch,)), axis=None))
    val_loss = val_total / len(val_batches)
    log(f"validation loss {val_loss:.4f} ({len(val_batches)} batches of {GLOBAL_BATCH} windows)")

    local, whole = state_bytes(model, optimizer)
    print(f"worker {rank}: parameters + optimizer state {local / 2**20:.2f} MiB held here, "
          f"whole model {whole / 2**20:.2f} MiB (ratio {local / whole:.3f})", flush=True)
    result = {
        "rank": rank, "workers": workers, "strategy": args.strategy, "steps": len(losses),
        "first_loss": losses[0], "last_loss": losses[-1], "losses": losses, "val_loss": val_loss,
        "local_bytes": local, "whole_bytes": whole, "train_s": train_s,
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
