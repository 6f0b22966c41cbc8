"""A worker of ``tests/test_sharded_checkpoint.py``: FullyShardedStrategy checkpoints.

``backup DIR CRASH_STEP``: two epochs under ``td.BackupAndRestore`` (a backup every 2 steps);
worker 1 dies (``os._exit``) at global step ``CRASH_STEP`` of the first attempt; the
launcher restarts both, they resume from the backup, report the final parameters.
``save DIR``: train, save twice with a ``CheckpointManager(max_to_keep=1)``, train on and
report the final parameters. ``restore DIR``: restore the newest sharded checkpoint, train on
as the saver did, report; then read ``DIR/plain.pt`` (a plain file) and train on, report.
Every worker prints one JSON line (``mw_helpers.emit``).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mw_helpers as H  # noqa: E402

import torch_distribute as td  # noqa: E402

GLOBAL_BATCH = 6


class Blocks(torch.nn.Module):
    """Two residual blocks in a ModuleList (each sharded on its own) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(4, 12)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(12), torch.nn.Linear(12, 12), torch.nn.Tanh()) for _ in range(2))
        self.head = torch.nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def batches(first: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches number ``first`` .. ``first + count - 1`` (the same in every process)."""
    out = []
    for i in range(first, first + count):
        g = torch.Generator().manual_seed(100 + i)
        rows = GLOBAL_BATCH if i % 3 else GLOBAL_BATCH - 1  # some ragged batches
        out.append((torch.randn(rows, 4, generator=g), torch.randint(0, 3, (rows,), generator=g)))
    return out


def build(strategy: td.Strategy, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    with strategy.scope():
        torch.manual_seed(seed)
        model = Blocks()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, optimizer


def train(strategy: td.Strategy, model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: list,
          distributed: bool = False) -> None:
    """One step per global batch of ``data`` (already per-replica batches if ``distributed``)."""
    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        loss = td.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"), global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    for batch in data if distributed else strategy.experimental_distribute_dataset(data):
        strategy.run(step, args=(batch,))


def whole(model: torch.nn.Module) -> list[float]:
    """Every parameter, gathered (a collective: every worker calls it)."""
    parts = []
    for p in model.parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        parts.append(t.detach().reshape(-1).cpu())
    return torch.cat(parts).tolist()


def main() -> None:
    mode, directory = sys.argv[1], sys.argv[2]
    strategy = td.FullyShardedStrategy(communication_options=td.CommunicationOptions(timeout_seconds=60))
    rank = strategy.extended.worker_index
    model, optimizer = build(strategy, seed=1 + rank)  # the chief's values win
    checkpoint = td.Checkpoint(model=model, optimizer=optimizer)
    out: dict = {"rank": rank}
    if mode == "backup":
        crash_step, marker = int(sys.argv[3]), os.path.join(directory, "crashed")
        backup = td.BackupAndRestore(checkpoint, os.path.join(directory, "backup"), save_freq=2)
        step = 0
        for _ in backup.epochs(2):
            for batch in backup.steps(strategy.experimental_distribute_dataset(batches(0, 4))):
                train(strategy, model, optimizer, [batch], distributed=True)
                step += 1
                if rank == 1 and step == crash_step and not os.path.exists(marker):
                    open(marker, "w").close()
                    os._exit(3)
        out["final"] = whole(model)
    elif mode == "save":
        manager = td.CheckpointManager(checkpoint, directory, max_to_keep=1)
        train(strategy, model, optimizer, batches(0, 3))
        manager.save()
        train(strategy, model, optimizer, batches(3, 2))
        out["saved"] = manager.save()
        out["files_after_save"] = sorted(os.listdir(directory))
        train(strategy, model, optimizer, batches(5, 3))
        out["final"] = whole(model)
        out["local_numel"] = sum(p.to_local().numel() for p in model.parameters())
    else:
        status = checkpoint.restore(td.latest_checkpoint(directory))
        status.assert_consumed()
        out["save_counter"] = checkpoint.save_counter
        train(strategy, model, optimizer, batches(5, 3))
        out["final"] = whole(model)
        checkpoint.read(os.path.join(directory, "plain.pt")).assert_consumed()
        train(strategy, model, optimizer, batches(5, 3))
        out["final_from_plain"] = whole(model)
    H.emit(out)


if __name__ == "__main__":
    main()
