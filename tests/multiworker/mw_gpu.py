"""One worker of a GPU multi-worker test; prints one ``MWRESULT {json}`` line.

    python mw_gpu.py --implementation auto|ring|nccl [--epochs E] [--bf16] [--compile]

Trains the shared tiny model on GPU ``local_rank % device_count`` under
``MultiWorkerMirroredStrategy`` (several workers may share one GPU: Gloo carries the CUDA tensors
then, under ``auto`` too; explicit NCCL needs a GPU per worker) and reports its parameters and
the backend in use.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mw_helpers as H  # noqa: E402

import torch_distribute as td  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--implementation", choices=["auto", "ring", "nccl"], default="auto")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--bf16", action="store_true", help="forward under torch.autocast(bfloat16)")
parser.add_argument("--compile", action="store_true", help="the distributed step under td.function")
args = parser.parse_args()

implementation = td.CommunicationImplementation[args.implementation.upper()]
local_rank = int(os.environ.get("LOCAL_RANK", "0"))
strategy = td.MultiWorkerMirroredStrategy(
    devices=[f"cuda:{local_rank % torch.cuda.device_count()}"],
    communication_options=td.CommunicationOptions(implementation=implementation, timeout_seconds=60))
rank = strategy.cluster_resolver.worker_index
torch.manual_seed(H.worker_seed(rank))
with strategy.scope():
    model = H.make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=H.LR)


def step(x, y, global_batch):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.bf16):
        logits = model(x)
    per_example = F.cross_entropy(logits.float(), y, reduction="none")
    loss = td.compute_average_loss(per_example, global_batch_size=global_batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def distributed_step(xb, yb, size):
    return strategy.reduce("sum", strategy.run(step, args=(xb, yb, size)), axis=None)


if args.compile:
    distributed_step = td.function(distributed_step)

x, y = H.make_data()
loader = H.make_loader(x, y)
losses = []
for _ in range(args.epochs):
    for (xb, yb), size in zip(strategy.experimental_distribute_dataset(loader), H.global_batch_sizes(), strict=True):
        loss = distributed_step(xb, yb, size)
        losses.append(loss.item())
H.emit({
    "rank": rank,
    "params": H.flat(model),
    "losses": losses,
    "param_device": str(next(model.parameters()).device),
    "uses_nccl": bool(getattr(strategy.extended.worker_group, "uses_nccl", False)),
})
