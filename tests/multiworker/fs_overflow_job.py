"""One worker of a fully sharded job whose gradients overflow in one worker's shard only.

    python fs_overflow_job.py --steps N --overflow-at K

``FullyShardedStrategy`` over 2 workers, a ``Linear(4, 2)`` sharded by rows (worker 0 holds
row 0 of the weight and of the bias, worker 1 row 1), ``td.mixed_precision.LossScaleOptimizer``
around SGD. At step ``K`` the loss has a term in output 1 alone that overflows float32, so only
worker 1's shard of the gradient is inf; worker 0's is finite. Each step records, per worker,
whether its local shard of the gradient was finite, whether its local shard of the parameters
changed, and the loss scale after the step. Prints one ``MWRESULT``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mw_helpers as H  # noqa: E402

import torch_distribute as td  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--overflow-at", type=int, default=2)
args = parser.parse_args()

torch.set_num_threads(1)
strategy = td.FullyShardedStrategy(communication_options=td.CommunicationOptions(timeout_seconds=20))
rank = strategy.cluster_resolver.worker_index
torch.manual_seed(H.CHIEF_SEED)
with strategy.scope():
    model = torch.nn.Linear(4, 2)
    optimizer = td.mixed_precision.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
data = torch.Generator().manual_seed(7)
# A per-worker mean, knowingly: the reference (test_fully_sharded_loss_scale) doubles it.
strategy.set_loss_scaling_check(False)


def step(x: torch.Tensor, overflow: bool) -> None:
    y = model(x)
    loss = y[:, 0].square().mean() + y[:, 1].square().mean()
    if overflow:
        loss = loss + (y[:, 1] * 1e30).square().mean()  # inf in output 1's gradient only
    optimizer.get_scaled_loss(loss).backward()
    finite.append(all(bool(p.grad.to_local().isfinite().all()) for p in model.parameters()))
    optimizer.step()
    optimizer.zero_grad()


def local_shard() -> list[float]:
    return [v for p in model.parameters() for v in p.to_local().detach().reshape(-1).tolist()]


changed, scales, finite = [], [], []
for k in range(args.steps):
    x = torch.randn(2, 4, generator=data)
    before = local_shard()
    strategy.run(step, args=(x, k == args.overflow_at))
    changed.append(local_shard() != before)
    scales.append(optimizer.loss_scale)
H.emit({"rank": rank, "changed": changed, "scales": scales, "finite_local_grads": finite,
        "params": [v for p in model.parameters() for v in p.full_tensor().detach().reshape(-1).tolist()]})
