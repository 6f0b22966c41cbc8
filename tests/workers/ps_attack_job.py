"""A parameter-server job that waits to be attacked, then trains (tests/test_security.py).

    python ps_attack_job.py DONE_FILE
    python -m torch_distribute.ps.local_cluster --workers 1 --ps 1 ps_attack_job.py DONE_FILE

Started with ``create_in_process_cluster`` (one worker, one ps), or as one task per process
with a ``TF_CONFIG`` each (``local_cluster``). Prints ``CLUSTER {...}``
(every task's address) once the strategy is made, waits for ``DONE_FILE`` to exist (the
attacks are over), trains 20 steps on one worker, and prints ``RESULT {...}``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import torch_distribute as td

if "TF_CONFIG" in os.environ:
    if td.distribute_server():
        sys.exit(0)
    resolver = td.cluster_resolver.TFConfigClusterResolver()
else:
    resolver = td.ps.create_in_process_cluster(num_workers=1, num_ps=1)
strategy = td.ParameterServerStrategy(resolver, startup_timeout=120)
coordinator = td.coordinator.ClusterCoordinator(strategy)
torch.manual_seed(0)
features = torch.randn(256, 4)
labels = features @ torch.tensor([1.0, -2.0, 3.0, 0.5]) + 1.0
with strategy.scope():
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
initial = model.weight.detach().clone()
print("CLUSTER " + json.dumps(resolver.cluster_spec().as_dict()), flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.1)


def dataset_fn(input_context):
    generator = torch.Generator().manual_seed(input_context.input_pipeline_id)
    while True:
        index = torch.randint(0, len(features), (32,), generator=generator)
        yield features[index], labels[index]


iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))


def train_step(batches):
    x, y = next(batches)
    loss = F.mse_loss(model(x).squeeze(-1), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


untouched = bool(torch.equal(model.weight.detach(), initial))  # the intruder's assign did not land
losses = [coordinator.schedule(train_step, args=(iterator,)) for _ in range(20)]
coordinator.join()
print("RESULT " + json.dumps({"untouched": untouched, "last_loss": coordinator.fetch(losses[-1]).item(),
                              "steps": coordinator.worker_stats}), flush=True)
