"""A fault-tolerant MultiWorkerMirroredStrategy job for tests/test_fault_tolerant.py.

Started by ``torch-distribute launch --nproc 3 --min-workers 2``. Trains ``ft_model`` on
``ft_data``'s global batches, cut over each step's live workers, for ``--epochs`` epochs
through ``ft.epochs``. Prints, for the test to follow and to act on:

    FTSTART <slot> <pid> <generation>
    FTSTEP <slot> <pid> <committed step> <live workers> <epoch>     (after every step)
    FTRESULT {...}                                                  (at the end)

Every epoch ends with a collective save (``CheckpointManager.save``, numbered by the committed
step) into ``--checkpoints``.

``FT_SELF_KILL=<slot>:<step>``: the first process of that slot kills itself (SIGKILL) inside
the step after committed step ``<step>``, between its backward and its optimizer step, while
the others are in the gradient all-reduce. While fewer than 3 workers are live each step
sleeps 0.25 s, so that a replacement has time to join before the job ends (sleeping changes
no number).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch_distribute as td  # noqa: E402
from workers.ft_common import GAMMA, GLOBAL_BATCH, LR, SEED, digest, make_loader, make_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--step-sleep", type=float, default=0.02)
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--checkpoints", required=True)
    args = parser.parse_args()
    slot = int(os.environ["RANK"])
    generation = int(os.environ.get("TD_RESTART_COUNT", "0"))
    print(f"FTSTART {slot} {os.getpid()} {generation}", flush=True)
    kill_slot, _, kill_step = os.environ.get("FT_SELF_KILL", "-1:-1").partition(":")
    kill_at = int(kill_step) if int(kill_slot) == slot and generation == 0 else -1

    torch.manual_seed(SEED)
    ft = td.experimental.FaultTolerance(timeout=args.timeout, quorum_timeout=120)
    strategy = td.MultiWorkerMirroredStrategy(fault_tolerance=ft)
    with strategy.scope():
        model = make_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=GAMMA)
    dataset = strategy.experimental_distribute_dataset(make_loader())
    # Collective saves over the workers of the moment, numbered by the job's committed step
    # (the same on a worker that joined), into one directory every worker sees.
    manager = td.CheckpointManager(td.Checkpoint(model=model, optimizer=optimizer), args.checkpoints, max_to_keep=2)

    def train_step(x, y):
        loss = td.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"), global_batch_size=GLOBAL_BATCH)
        loss.backward()
        if ft.committed_step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # lost in the middle of the step
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()  # not on a dropped step: the strategy skips it
        return loss

    step = td.function(train_step) if args.compiled else train_step
    for epoch in ft.epochs(args.epochs):
        for x, y in dataset:
            strategy.run(step, args=(x, y))
            live = strategy.num_replicas_in_sync
            print(f"FTSTEP {slot} {os.getpid()} {ft.committed_step} {live} {epoch}", flush=True)
            time.sleep(args.step_sleep if live == 3 else 0.25)
        manager.save(checkpoint_number=ft.committed_step)
    result = {"slot": slot, "pid": os.getpid(), "generation": generation, "committed": ft.committed_step,
              "params": digest(list(model.parameters())), "optimizer": digest(optimizer.state_dict()),
              "schedule": schedule.state_dict()["last_epoch"],
              "values": [p.detach().reshape(-1).tolist() for p in model.parameters()]}
    print("FTRESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
