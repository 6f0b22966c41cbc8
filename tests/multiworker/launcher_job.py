"""The tutorial's 2-worker step, started by a real launcher; prints one ``MWRESULT`` line.

    python launcher_job.py [--init-process-group | --accelerator] [--fsdp-check] [--timeout S]

Run unchanged under torchrun, ``torch-distribute launch``, ``mpirun``, ``srun``,
``accelerate launch``, Kubeflow's ``PET_*`` (``tests/test_real_launchers.py``) and, through
``train_and_report``, Ray Train's ``TorchTrainer``: ``td.MultiWorkerMirroredStrategy()``
with no arguments finds its cluster (or adopts the process group the launcher or the user
made), trains ``mw_helpers``' model and data for ``EPOCHS`` epochs, and reports the
parameters, which must equal one process's with the same global batch.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mw_helpers as H  # noqa: E402

import torch_distribute as td  # noqa: E402

EPOCHS = 2


def train_and_report(fsdp_check: bool = False, timeout: float | None = None) -> dict:
    """Build the strategy, train, and return this worker's result (rank, params, topology).

    ``timeout``: ``CommunicationOptions(timeout_seconds=...)`` (default: none given)."""
    torch.set_num_threads(1)
    adopted = dist.is_initialized()
    options = None if timeout is None else td.CommunicationOptions(timeout_seconds=timeout)
    strategy = td.MultiWorkerMirroredStrategy(communication_options=options)
    rank = strategy.extended.worker_index
    torch.manual_seed(H.worker_seed(rank))
    with strategy.scope():
        model = H.make_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=H.LR)
    x, y = H.make_data()
    dist_ds = strategy.experimental_distribute_dataset(H.make_loader(x, y))
    sizes = H.global_batch_sizes()

    def step(batch, global_batch_size):
        xb, yb = batch
        per_example = F.cross_entropy(model(xb), yb, reduction="none")
        loss = td.compute_average_loss(per_example, global_batch_size=global_batch_size)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    for _ in range(EPOCHS):
        for index, batch in enumerate(dist_ds):
            strategy.run(step, args=(batch, sizes[index]))
    result = {"rank": rank, "params": H.flat(model), "num_workers": strategy.extended.num_workers_in_sync,
              "resolver": type(strategy.cluster_resolver).__name__, "adopted": adopted}
    group = strategy.extended.worker_group
    if fsdp_check:
        sharded = td.FullyShardedStrategy()
        total = sharded.reduce(td.ReduceOp.SUM, torch.tensor(float(sharded.extended.worker_index + 1)), axis=None)
        result["fsdp"] = {"num_workers": sharded.extended.num_workers_in_sync,
                          "worker_index": sharded.extended.worker_index, "sum": float(total)}
        sharded.extended.worker_group.close()
    if group is not None:
        group.close()
    # The strategy never destroys a process group it did not make.
    result["still_initialized_after_close"] = dist.is_initialized()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--init-process-group", action="store_true",
                        help="make the process group first, as the user's own code would")
    parser.add_argument("--accelerator", action="store_true",
                        help="make accelerate's Accelerator() first (it makes the process group)")
    parser.add_argument("--fsdp-check", action="store_true")
    parser.add_argument("--timeout", type=float, default=None)
    args = parser.parse_args()
    if args.init_process_group:
        dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    if args.accelerator:
        from accelerate import Accelerator

        Accelerator()
    result = train_and_report(args.fsdp_check, args.timeout)
    H.emit(result)
    if args.init_process_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
