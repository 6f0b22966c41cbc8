"""One worker of ``bench_fault_tolerant.py``'s jobs: the tutorial CNN under MultiWorkerMirroredStrategy.

``--mode ft``: with ``td.experimental.FaultTolerance`` (launched with ``--min-workers``);
``--mode plain``: without, resumable from a ``td.BackupAndRestore`` in ``--backup-dir`` (every
``--save-freq`` steps), as a job restarted whole by ``--max-restarts`` resumes. The worker of
slot 1 kills itself (SIGKILL) at step ``--kill-at`` in its first life. Prints ``BENCHSTEP
<wall clock> <seconds of the step> <step>`` after every step and ``BENCHDONE <wall clock>``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import global_batches, make_model, make_optimizer  # noqa: E402

import torch_distribute as td  # noqa: E402

GLOBAL_BATCH = 96  # 32 rows per worker with 3, 48 with 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("ft", "plain"), required=True)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--backup-dir", default=None)
    parser.add_argument("--save-freq", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    slot = int(os.environ["RANK"])
    first_life = os.environ.get("TD_RESTART_COUNT", "0") == "0"
    ft = td.experimental.FaultTolerance(timeout=10) if args.mode == "ft" else None
    strategy = td.MultiWorkerMirroredStrategy(fault_tolerance=ft)
    with strategy.scope():
        model = make_model()
        optimizer = make_optimizer(model)
    dataset = strategy.experimental_distribute_dataset(global_batches(GLOBAL_BATCH, num_images=GLOBAL_BATCH * 10))

    def step(x, y):
        loss = td.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"), global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    backup = None
    if args.mode == "plain" and args.backup_dir:
        backup = td.BackupAndRestore(td.Checkpoint(model=model, optimizer=optimizer), args.backup_dir,
                                     save_freq=args.save_freq)
    epochs = ft.epochs(args.epochs) if ft is not None else backup.epochs(args.epochs) if backup else range(args.epochs)
    done = 0
    for _ in epochs:
        start = time.perf_counter()  # a step: reading its batch (the quorum, under ft) and running it
        for x, y in (backup.steps(dataset) if backup is not None else dataset):
            if slot == 1 and first_life and (ft.committed_step if ft else done) == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            strategy.run(step, args=(x, y))
            done = ft.committed_step if ft is not None else (backup.global_step + 1 if backup else done + 1)
            now = time.perf_counter()
            print(f"BENCHSTEP {time.time():.4f} {now - start:.6f} {done}", flush=True)
            start = time.perf_counter()
    print(f"BENCHDONE {time.time():.4f}", flush=True)


if __name__ == "__main__":
    main()
