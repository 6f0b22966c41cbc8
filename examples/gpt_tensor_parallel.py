"""A small GPT trained with tensor parallelism on a 2-D mesh: ``FullyShardedStrategy`` with a
``LayoutMap``, one process per worker.

The workers form a ``(data, model)`` mesh. Each global batch is split over the ``data`` axis;
the attention and MLP matrices of every block are split over the ``model`` axis (Megatron's
column/row pairs: query, key, value and the MLP's first layer split by output features, the
attention's output projection and the MLP's second layer by input features), and FSDP2 shards
what each worker holds over the ``data`` axis. ``--sequence-parallel`` also splits the norms'
inputs and outputs along the sequence. The training step is the same as for every strategy;
only the strategy line differs from ``gpt_fully_sharded.py``.

    python -m torch_distribute.launch --nproc 4 examples/gpt_tensor_parallel.py --mesh 2,2
    python -m torch_distribute.launch --nproc 4 examples/gpt_tensor_parallel.py --mesh 1,4 --sequence-parallel
    python -m torch_distribute.launch --nproc 2 examples/gpt_tensor_parallel.py --mesh 1,2 --steps 50

The model is built in the strategy's scope without being allocated anywhere: each worker
allocates and fills only its shards, with the values one process would have drawn for the
same seed. Data and model as in ``gpt_fully_sharded.py`` (the source text of a few standard
library modules, no download), except that attention has separate query/key/value layers
(a fused one cannot be split by heads) and the output layer is not tied to the embedding.

Printed by the chief: the global loss every ``--log-every`` steps and the validation loss; by
every worker: the bytes of its parameters and optimizer state against the whole model's, its
peak resident memory, and a final ``GPTRESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import time

import torch
import torch.nn.functional as F
from torch import nn

import torch_distribute as td

try:  # run as a script (python examples/...) or imported as examples.gpt_tensor_parallel
    from gpt_fully_sharded import CharData, load_text, make_batches, state_bytes
except ImportError:
    from examples.gpt_fully_sharded import CharData, load_text, make_batches, state_bytes

RESULT_PREFIX = "GPTRESULT "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default=None, help="data,model workers (default: 1,<all workers>)")
    parser.add_argument("--sequence-parallel", action="store_true", help="split the norms along the sequence")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128, help="model width (heads of 32 channels)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--val-batches", type=int, default=4)
    return parser.parse_args(argv)


# -- model: separate q/k/v, views with -1 heads (a worker holds its share of the heads) -----------
class Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.head_dim = width // heads
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(width), Attention(width, heads)
        self.ln2, self.mlp = nn.LayerNorm(width), MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embeddings(nn.Module):
    """Tokens and positions together: one module, whose output the layout can split."""

    def __init__(self, vocab_size: int, seq_len: int, width: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab_size, width), nn.Embedding(seq_len, width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, width: int, layers: int, heads: int):
        super().__init__()
        self.embed = Embeddings(vocab_size, seq_len, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2's initialisation; residual projections scaled down with depth
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_model(vocab_size: int, args: argparse.Namespace) -> GPT:
    # The vocabulary padded to a multiple of 32, so that the model axis divides the output
    # layer (a size it does not divide is refused when the model is sharded).
    padded = -(-vocab_size // 32) * 32
    return GPT(padded, args.seq_len, args.width, args.layers, max(1, args.width // 32))


def layout_map(mesh: td.DeviceMesh, sequence_parallel: bool = False) -> td.LayoutMap:
    """Megatron's splits for this GPT, as one axis (or None) per dimension of each weight."""
    layouts = td.LayoutMap(mesh)
    layouts[r"attn\.(q|k|v)\.weight"] = ("model", None)  # (out, in): the heads split
    layouts[r"attn\.(q|k|v)\.bias"] = ("model",)
    layouts[r"attn\.proj\.weight"] = (None, "model")  # the heads' outputs summed over the axis
    layouts[r"mlp\.up\.weight"] = ("model", None)
    layouts[r"mlp\.up\.bias"] = ("model",)
    layouts[r"mlp\.down\.weight"] = (None, "model")
    layouts[r"head\.weight"] = ("model", None)  # the vocabulary split, logits gathered whole
    if sequence_parallel:  # between the split layers, activations split along the sequence
        layouts[r"(embed|ln1|ln2|ln_f)\.output"] = ("data", "model", None)
    return layouts


def per_window_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1)


def make_strategy(args: argparse.Namespace, num_workers: int) -> td.FullyShardedStrategy:
    data, model = (int(n) for n in args.mesh.split(",")) if args.mesh else (1, num_workers)
    mesh = td.DeviceMesh((data, model), ("data", "model"))
    return td.FullyShardedStrategy(layout_map=layout_map(mesh, args.sequence_parallel))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    data = CharData(load_text())
    strategy = make_strategy(args, td.cluster.resolve_cluster().num_workers)
    rank = strategy.extended.worker_index
    log = print if strategy.extended.should_checkpoint else (lambda *_a, **_k: None)
    replicas = strategy.num_replicas_in_sync  # positions along the data axis
    log(f"mesh {strategy.extended.device_mesh}: {replicas} replica(s), text {len(data.train)} characters")

    with strategy.scope():  # nothing allocated here: each worker fills its shards when sharded
        model = make_model(data.vocab_size, args)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    log(f"GPT: {args.layers} layers, width {args.width}, {sum(p.numel() for p in model.parameters()):,} parameters")

    global_batch = args.global_batch_size
    train_batches = make_batches(data.train, args.steps, global_batch, args.seq_len, args.seed)
    val_batches = make_batches(data.val, args.val_batches, global_batch, args.seq_len, args.seed + 1)

    def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        loss = td.compute_average_loss(per_window_loss(model, *batch), global_batch_size=global_batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def val_step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return td.compute_average_loss(per_window_loss(model, *batch), global_batch_size=global_batch)

    losses = []
    started = time.perf_counter()
    for step, batch in enumerate(strategy.experimental_distribute_dataset(train_batches), start=1):
        losses.append(float(strategy.reduce("sum", strategy.run(train_step, args=(batch,)), axis=None)))
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            elapsed = time.perf_counter() - started
            log(f"step {step:4d}  loss {losses[-1]:.4f}  ({1e3 * elapsed / step:.0f} ms/step)")
    train_s = time.perf_counter() - started
    val_loss = sum(float(strategy.reduce("sum", strategy.run(val_step, args=(b,)), axis=None))
                   for b in strategy.experimental_distribute_dataset(val_batches)) / len(val_batches)
    log(f"validation loss {val_loss:.4f}")

    local, whole = state_bytes(model, optimizer)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"worker {rank}: parameters + optimizer state {local / 2**20:.2f} MiB of {whole / 2**20:.2f} MiB "
          f"(ratio {local / whole:.3f}); peak RSS {peak / 2**20:.0f} MiB", flush=True)
    result = {"rank": rank, "mesh": list(strategy.extended.device_mesh.shape), "steps": len(losses),
              "first_loss": losses[0], "last_loss": losses[-1], "val_loss": val_loss,
              "local_bytes": local, "whole_bytes": whole, "peak_rss": peak, "train_s": train_s}
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
