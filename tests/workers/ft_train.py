"""Worker for the fault-tolerance tests: an MLP with dropout on shuffled data, under
``td.BackupAndRestore``. Prints one JSON line with the final parameters.

    python ft_train.py --backup-dir DIR [--multi] [--kill-at STEP] [--term-at STEP]

``--kill-at``/``--term-at``: on the first attempt (TD_RESTART_COUNT=0), rank 1 (or the only
worker) sends itself SIGKILL / SIGTERM after that many completed steps.
"""

import argparse
import json
import os
import signal

import torch
import torch.nn.functional as F

import torch_distribute as td

parser = argparse.ArgumentParser()
parser.add_argument("--backup-dir", required=True)
parser.add_argument("--multi", action="store_true")
parser.add_argument("--kill-at", type=int, default=None)
parser.add_argument("--term-at", type=int, default=None)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--save-freq", default="3")
args = parser.parse_args()

torch.set_num_threads(1)
rank = int(os.environ.get("RANK", "0"))
attempt = int(os.environ.get("TD_RESTART_COUNT", "0"))
# Fresh seeds on every attempt and worker: resuming must not depend on them.
torch.manual_seed(1000 * attempt + rank + 1)

if args.multi:
    strategy = td.MultiWorkerMirroredStrategy(
        communication_options=td.CommunicationOptions(timeout_seconds=20))
else:
    strategy = td.OneDeviceStrategy("cpu")

data_generator = torch.Generator().manual_seed(5)
X = torch.randn(64, 4, generator=data_generator)
Y = torch.randint(0, 3, (64,), generator=data_generator)
loader = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(X, Y), batch_size=8, shuffle=True,
    generator=torch.Generator().manual_seed(3))
dist_ds = strategy.experimental_distribute_dataset(loader)

with strategy.scope():
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    train_loss = td.metrics.Mean()
checkpoint = td.Checkpoint(model=model, optimizer=optimizer, train_loss=train_loss)
save_freq = args.save_freq if args.save_freq == "epoch" else int(args.save_freq)
backup = td.BackupAndRestore(checkpoint, args.backup_dir, save_freq=save_freq)
if backup.restored_from:
    print(f"restored epoch={backup.initial_epoch} step={backup.global_step}", flush=True)


def train_step(x, y):
    loss = td.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"), global_batch_size=8)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    train_loss.update_state(loss.detach() * strategy.num_replicas_in_sync)
    return loss


for _epoch in backup.epochs(args.epochs):
    for x, y in backup.steps(dist_ds):
        strategy.run(train_step, args=(x, y))
        done = backup.global_step + 1
        if attempt == 0 and rank == (1 if args.multi else 0):
            if done == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if done == args.term_at:
                os.kill(os.getpid(), signal.SIGTERM)

flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
print(json.dumps({"rank": rank, "steps": backup.global_step, "loss": float(train_loss.result()),
                  "params": flat.tolist()}), flush=True)
