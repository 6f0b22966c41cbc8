"""TensorFlow's single-program form: ``create_in_process_cluster``, then train.

``--end`` says how the coordinator ends after training: ``normal`` (exit 0), ``raise`` (an
uncaught exception), ``hang`` (waits to be killed: SIGTERM, SIGKILL). It prints ``PIDS [...]`` (its worker
and ps tasks, and its own interpreter that forked them if any) once they run, and ``RESULT {...}`` after training.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import torch_distribute as td


def parents() -> dict[int, int]:
    """Every process's parent."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    found[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return found


def started_by_the_cluster() -> list[int]:
    """Every process below this one: the tasks (fresh interpreters, its children)."""
    parent_of = parents()
    found, todo = [], [os.getpid()]
    while todo:
        above = todo.pop()
        below = [pid for pid, parent in parent_of.items() if parent == above]
        found += below
        todo += below
    return sorted(found)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--end", choices=["normal", "raise", "hang"], default="normal")
    args = parser.parse_args()

    cluster_resolver = td.ps.create_in_process_cluster(num_workers=2, num_ps=1)
    print("PIDS " + json.dumps(started_by_the_cluster()), flush=True)
    strategy = td.ParameterServerStrategy(cluster_resolver, startup_timeout=60)
    coordinator = td.coordinator.ClusterCoordinator(strategy)

    torch.manual_seed(0)
    features = torch.randn(256, 4)
    labels = features @ torch.tensor([1.0, -2.0, 3.0, 0.5]) + 1.0
    with strategy.scope():
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def dataset_fn(input_context):
        generator = torch.Generator().manual_seed(input_context.input_pipeline_id)
        while True:
            index = torch.randint(0, len(features), (32,), generator=generator)
            yield features[index], labels[index]

    per_worker_iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def train_step(iterator):
        x, y = next(iterator)
        loss = F.mse_loss(model(x).squeeze(-1), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    def evaluate() -> float:
        with torch.no_grad():
            return F.mse_loss(model(features).squeeze(-1), labels).item()

    before = evaluate()
    losses = [coordinator.schedule(train_step, args=(per_worker_iterator,)) for _ in range(20)]
    coordinator.join()
    print("RESULT " + json.dumps({"before": before, "after": evaluate(),
                                  "last_loss": coordinator.fetch(losses[-1]).item(),
                                  "workers": coordinator.worker_stats}), flush=True)
    if args.end == "raise":
        raise RuntimeError("the coordinator's program failed")
    if args.end == "hang":
        time.sleep(600)
