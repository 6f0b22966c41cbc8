"""A worker of ``tests/test_uneven_data.py``: workers with different amounts of data.

    python uneven_job.py MODE COUNTS [--timeout S] [--bench N] [--no-verify]

``MODE`` is how the input is distributed: ``data`` (``experimental_distribute_dataset`` of
a *sized* list of global batches, ``AutoShardPolicy.DATA``), ``off`` (each worker reads its
own list of global batches, ``AutoShardPolicy.OFF``: each batch makes two steps of half its
rows, TensorFlow's rule) or ``function`` (``distribute_datasets_from_function``, each worker
its own batches). ``COUNTS`` is the number of batches of each worker
(``"20,17"``): worker ``w`` has the first ``COUNTS[w]`` batches of one sequence
(``batches``), so the workers agree on the batches they share and differ in how many.

Every worker trains a linear model with SGD (loss = per-example squared error summed over
the worker's rows, divided by the global batch size, as ``td.compute_average_loss`` does)
over the whole dataset and prints one ``MWRESULT`` line: its rank, the steps it ran, the
rows it trained on at each step and its final parameters. With ``--bench N`` it also times
N calls of ``extended.gather_input_reports`` (the per-step agreement) and N training steps.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mw_helpers as H  # noqa: E402

import torch_distribute as td  # noqa: E402

GLOBAL_BATCH = 8
FEATURES = 4
LR = 0.1


def batches(count: int, rows: int = GLOBAL_BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``count`` batches of one sequence (the same in every process)."""
    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(1000 + i)
        x = torch.randn(rows, FEATURES, generator=g)
        out.append((x, x.sum(1, keepdim=True) * 0.5 + 1.0))
    return out


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1)


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Squared error summed over the rows given, over the global batch size."""
    per_example = (model(x) - y).pow(2).squeeze(1)
    return td.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["data", "off", "function"])
    parser.add_argument("counts")
    parser.add_argument("--timeout", type=float, default=30)
    parser.add_argument("--bench", type=int, default=0)
    parser.add_argument("--no-verify", action="store_true",
                        help="CommunicationOptions(verify_collectives=False)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    strategy = td.MultiWorkerMirroredStrategy(
        communication_options=td.CommunicationOptions(timeout_seconds=args.timeout,
                                                      verify_collectives=not args.no_verify))
    rank = strategy.extended.worker_index
    workers = strategy.extended.num_workers_in_sync
    counts = [int(c) for c in args.counts.split(",")]
    assert len(counts) == workers, (counts, workers)

    with strategy.scope():
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    if args.mode == "function":
        rows = GLOBAL_BATCH // workers  # each worker's own share of every global batch

        def dataset_fn(context: td.InputContext) -> list:
            assert context.input_pipeline_id == rank
            return [(x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows])
                    for x, y in batches(counts[rank])]

        dataset = strategy.distribute_datasets_from_function(dataset_fn)
    else:
        policy = td.AutoShardPolicy.DATA if args.mode == "data" else td.AutoShardPolicy.OFF
        mine = batches(counts[rank])  # a list of global batches: a sized dataset
        dataset = strategy.experimental_distribute_dataset(
            mine, options=td.InputOptions(auto_shard_policy=policy))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return torch.tensor(float(x.shape[0]))

    started = time.monotonic()
    local_rows, global_rows = [], []
    for x, y in dataset:
        local_rows.append(int(x.shape[0]))
        global_rows.append(int(strategy.reduce("sum", strategy.run(step, args=(x, y)), axis=None)))
    result = {"rank": rank, "steps": len(local_rows), "local_rows": local_rows,
              "global_rows": global_rows, "params": H.flat(model),
              "seconds": time.monotonic() - started}

    if args.bench:
        # The per-step agreement alone, then whole steps on one fixed batch (with it).
        report = td.input.step_agreement.StepReport(True, GLOBAL_BATCH // workers, 0)
        strategy.extended.gather_input_reports(report)
        t0 = time.perf_counter()
        for _ in range(args.bench):
            strategy.extended.gather_input_reports(report)
        result["agree_us"] = (time.perf_counter() - t0) / args.bench * 1e6
        # What the agreement is made of: one all-reduce of one integer (gloo), without the
        # library's check that every worker makes the same collective.
        flag = torch.ones(1, dtype=torch.int64)
        t0 = time.perf_counter()
        for _ in range(args.bench):
            torch.distributed.all_reduce(flag.fill_(1))
        result["raw_all_reduce_us"] = (time.perf_counter() - t0) / args.bench * 1e6
        x, y = batches(1, GLOBAL_BATCH // workers)[0]
        t0 = time.perf_counter()
        for _ in range(args.bench):
            strategy.run(step, args=(x, y))
        result["step_us"] = (time.perf_counter() - t0) / args.bench * 1e6
    H.emit(result)


if __name__ == "__main__":
    main()
