"""A worker of ``tests/test_input_api.py``: the input API across two worker processes.

    python input_api_job.py

Worker ``w`` reads its own data (``td.data.with_options``, ``AutoShardPolicy.OFF``), batched
by the global batch of 8 as TensorFlow has it: each batch makes two steps of 4 rows on each
worker. Worker 0 has 3 batches, worker 1 has 2. It prints one ``MWRESULT`` line with what
``get_next_as_optional`` gave at each call, the rows it got, how many times the workers
agreed on the data, and the parameters ``fit`` trained on each worker's own rows.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mw_helpers as H  # noqa: E402

import torch_distribute as td  # noqa: E402

ROWS = 8  # a global batch: each worker's steps take 4 of its rows


def share(worker: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Worker ``worker``'s own batches (the same function in the test's reference)."""
    out = []
    for step in range(count):
        g = torch.Generator().manual_seed(100 * worker + step)
        x = torch.randn(ROWS, 3, generator=g)
        out.append((x, x.sum(1) * 0.5 - 1.0))
    return out


def own_policy(dataset: list) -> td.data.DatasetWithOptions:
    options = td.data.Options()
    options.experimental_distribute.auto_shard_policy = td.data.AutoShardPolicy.OFF
    return td.data.with_options(dataset, options)


def ddp_sampler_habit(strategy: td.MultiWorkerMirroredStrategy) -> tuple[str, int]:
    """A DDP loader, ``DistributedSampler(dataset)`` (its shard from the process group), given to
    experimental_distribute_dataset: the error; then the same loader declared as this worker's
    share (AutoShardPolicy.OFF, batched by the global batch of 2): the rows this worker reads in
    an epoch."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    examples = TensorDataset(torch.arange(16.0).reshape(8, 2))
    loader = DataLoader(examples, batch_size=2, sampler=DistributedSampler(examples, shuffle=False))
    try:
        strategy.experimental_distribute_dataset(loader)
        refused = ""
    except td.DatasetError as error:
        refused = str(error)
    declared = strategy.experimental_distribute_dataset(own_policy(loader))
    rows = sum(int(strategy.experimental_local_results(x)[0].shape[0]) for (x,) in declared)
    return refused, rows


def rank_seeded_shuffle(strategy: td.MultiWorkerMirroredStrategy) -> str:
    """A DDP habit: each worker's loader shuffles with a seed of its own (rank). Under DATA the
    workers would keep their rows of different global batches: the error every worker raises."""
    from torch.utils.data import DataLoader, TensorDataset

    rank = strategy.extended.worker_index
    examples = TensorDataset(torch.arange(64.0).reshape(32, 2))
    loader = DataLoader(examples, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(rank))
    try:
        for _ in strategy.experimental_distribute_dataset(loader):
            pass
    except td.DatasetError as error:
        return str(error)
    return ""


def main() -> None:
    strategy = td.MultiWorkerMirroredStrategy(communication_options=td.CommunicationOptions(timeout_seconds=30))
    rank = strategy.extended.worker_index
    agreements = []
    agree = strategy.extended.gather_input_reports

    def counted(report):
        agreements.append(report.has_data)
        return agree(report)

    dataset = td.input.DistributedDataset(
        own_policy(share(rank, 3 - rank)), list(strategy.extended.replica_devices),
        num_workers=2, worker_index=rank, sync_step=counted)
    iterator = iter(dataset)
    has_value, local_rows = [], []
    for _ in range(8):
        optional = iterator.get_next_as_optional()
        has_value.append(optional.has_value())
        if optional.has_value():
            local_rows.append(int(strategy.experimental_local_results(optional.get_value()[0])[0].shape[0]))
    via_strategy = strategy.experimental_distribute_dataset(own_policy(share(rank, 2)))
    ddp_refused, ddp_declared_rows = ddp_sampler_habit(strategy)

    shuffled_by_rank = rank_seeded_shuffle(strategy)

    torch.manual_seed(0)
    with strategy.scope():
        model = td.keras.Model(torch.nn.Linear(3, 1))
    model.compile(td.keras.optimizers.SGD(learning_rate=0.1), td.keras.losses.MeanSquaredError())
    data = [(x, y.unsqueeze(1)) for x, y in share(rank, 2)]
    model.fit(own_policy(data), epochs=1, verbose=0)
    H.emit({"rank": rank, "has_value": has_value, "local_rows": local_rows, "agreements": len(agreements),
            "policy": via_strategy.shard_policy.name, "ddp_refused": ddp_refused,
            "ddp_declared_rows": ddp_declared_rows, "shuffled_by_rank": shuffled_by_rank,
            "params": [float(v) for p in model.parameters() for v in p.detach().reshape(-1)]})


if __name__ == "__main__":
    main()
