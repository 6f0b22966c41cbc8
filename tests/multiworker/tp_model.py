"""Shared by ``tests/test_tensor_parallel.py`` and its worker script ``tp_job.py``.

A small GPT (token and position embeddings in one module, 2 pre-norm blocks of attention
with separate q/k/v/o projections and a 4x MLP, a final norm, a head), its layout maps
(Megatron's column/row splits; with sequence parallelism; as torch's own plan), its data and
the one-process reference training. No pytest and no ``torch.distributed`` here.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

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


def vm_kib(field: str) -> int:
    """A field of this process's ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ``VmSize``), in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([full(p.detach()).float().reshape(-1).cpu() for p in model.parameters()])


def train(strategy: Any = None, steps: int = STEPS, model: nn.Module | None = None,
          optimizer: torch.optim.Optimizer | None = None, first_step: int = 0) -> dict:
    """Train the GPT (``strategy`` None: one process) on the global batches ``first_step``..."""
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
        losses.append(train_step(strategy, optimizer, lambda xb, yb: per_example_loss(model, xb, yb), x, y))
    return {"init": init, "params": flat(model), "losses": losses, "model": model, "optimizer": optimizer}


def train_step(strategy: Any, optimizer: torch.optim.Optimizer,
               per_example: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               x: torch.Tensor, y: torch.Tensor) -> float:
    """One step on the global batch ``(x, y)``: in one process (``strategy`` None), the mean of
    ``per_example`` over the global batch; under ``strategy``, ``td.compute_average_loss`` in
    ``strategy.run``. Returns the global loss."""
    import torch_distribute as td

    if strategy is None:
        loss = per_example(x, y).sum() / GLOBAL_BATCH
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    def replica_step(batch: Any) -> torch.Tensor:
        loss = td.compute_average_loss(per_example(*batch), global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    return float(strategy.reduce(td.ReduceOp.SUM, strategy.run(replica_step, args=(batch,)), axis=None))


def parse_results(text: str) -> dict[str, dict[int, dict]]:
    """``{section: {rank: {"value"|"error": ..., "seconds": s}}}`` from the workers' lines."""
    out: dict[str, dict[int, dict]] = {}
    for line in text.splitlines():
        if line.startswith("[rank ") and "] " in line:
            line = line.split("] ", 1)[1]
        if line.startswith(RESULT_PREFIX):
            payload = json.loads(line[len(RESULT_PREFIX):])
            out.setdefault(payload["section"], {})[payload["rank"]] = payload
    return out


def encode(tensor: torch.Tensor) -> str:
    """A float32 tensor as base64 text, exact and compact."""
    return base64.b64encode(tensor.detach().float().contiguous().numpy().tobytes()).decode("ascii")


def decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.float32)


def emit(payload: dict) -> None:
    print(RESULT_PREFIX + json.dumps(payload), flush=True)


KERAS_SAMPLES = 24


def keras_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows for ``fit``: 3 global batches of 8."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randint(0, VOCAB, (KERAS_SAMPLES, SEQ), generator=generator)
    return x, (3 * x + 1) % VOCAB


def keras_reference() -> dict:
    """``td.keras.Model.fit`` of the GPT with no strategy: what every mesh must give."""
    import torch_distribute as td

    torch.manual_seed(SEED)
    model = td.keras.Model(GPT())
    model.compile(td.keras.optimizers.AdamW(learning_rate=LR, epsilon=EPS, weight_decay=0.01),
                  td.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = keras_data()
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0, shuffle=False)
    return {"params": flat(model), "loss": history.history["loss"]}


# transformers' Llama, built from a config (no download): the layout its own tp_plan describes.
LLAMA = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": SEQ}


def llama_layout_map(mesh: Any) -> Any:
    import torch_distribute as td

    layout_map = td.LayoutMap(mesh)
    layout_map[r"self_attn\.(q|k|v)_proj\.weight"] = ("model", None)
    layout_map[r"self_attn\.o_proj\.weight"] = (None, "model")
    layout_map[r"mlp\.(gate|up)_proj\.weight"] = ("model", None)
    layout_map[r"mlp\.down_proj\.weight"] = (None, "model")
    layout_map[r"lm_head\.weight"] = ("model", None)
    return layout_map


def train_llama(strategy: Any = None, steps: int = 3) -> dict:
    """Train a tiny Llama (``transformers``) on the GPT's batches (``strategy`` None: one process)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = LlamaForCausalLM(LlamaConfig(**LLAMA))
        optimizer = make_optimizer(model.parameters())

    def per_example(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=xb).logits.float()
        per_token = F.cross_entropy(logits.reshape(-1, LLAMA["vocab_size"]), yb.reshape(-1), reduction="none")
        return per_token.reshape(xb.shape[0], SEQ).mean(dim=1)

    losses = []
    for step in range(steps):
        x, y = make_data(step)
        x, y = x * 2, y * 2  # the whole vocabulary of 64

        losses.append(train_step(strategy, optimizer, per_example, x, y))
    return {"params": flat(model), "losses": losses, "model": model}
