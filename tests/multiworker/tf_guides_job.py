"""A worker of ``tests/test_tf_guides_multi_worker.py``: the multi-worker cells of TensorFlow's
"Distributed training with TensorFlow" and "Distributed input" guides, and the 1-vs-N
training equalities where a dataset's batch, the shard policy and the worker count meet.

    python tf_guides_job.py DATA_DIR

``DATA_DIR`` holds the files the test wrote (``write_files``): the input guide's two text
files (``f0.txt``: 0..5, ``f1.txt``: 6..11) and the training examples in ``TRAIN_FILES``
text files. Each worker prints one ``MWRESULT`` line: for each section, what it gave (or the
exception it raised, as ``{"error": type name, "message": ...}``).

The guides' cells are ported with mechanical changes (``tf.distribute.X`` -> ``td.X``,
``tf.data.Dataset.range(n).batch(g)`` -> ``DataLoader(torch.arange(n), batch_size=g)``);
``tf.data.TextLineDataset(tf.data.Dataset.list_files(...))`` has no counterpart and is
``TextLineFiles``, a dataset of files with the ``shard(num_shards, index)`` method that
AutoShardPolicy.FILE needs.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mw_helpers as H  # noqa: E402

import torch_distribute as td  # noqa: E402

GLOBAL_BATCH = 4
FEATURES = 3
LR = 0.1
#: Rows of the training examples in each file: workers 0 and 1 get files 0, 2 and 1, 3 under
#: FILE (11 rows each: batches of 4, 4, 3 make steps of 2, 2, 2, 2, 2 and 1 rows).
TRAIN_FILE_ROWS = (6, 5, 5, 6)


# -- the data, the same in the workers and in the test's references -----------------------------


def examples() -> tuple[torch.Tensor, torch.Tensor]:
    """22 training examples: ``x`` (22, 3) and ``y`` (22, 1), exactly representable as text."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randint(-20, 21, (sum(TRAIN_FILE_ROWS), FEATURES), generator=generator).float() / 8
    y = x @ torch.tensor([[0.5], [-1.0], [0.25]]) + 0.75
    return x, y


def train_files(data_dir: Path) -> list[Path]:
    return [data_dir / f"train{k}.txt" for k in range(len(TRAIN_FILE_ROWS))]


def write_files(data_dir: Path) -> None:
    """The input guide's two text files and the training examples split over 4 files."""
    for name, (start, stop) in (("f0.txt", (0, 6)), ("f1.txt", (6, 12))):
        (data_dir / name).write_text("".join(f"{i}\n" for i in range(start, stop)))
    x, y = examples()
    start = 0
    for path, rows in zip(train_files(data_dir), TRAIN_FILE_ROWS, strict=True):
        lines = [",".join(repr(float(v)) for v in [*x[i].tolist(), *y[i].tolist()])
                 for i in range(start, start + rows)]
        path.write_text("\n".join(lines) + "\n")
        start += rows


class TextLineFiles:
    """``tf.data.TextLineDataset(tf.data.Dataset.list_files(paths, shuffle=False))``, each line
    parsed by ``parse``, batched by ``batch_size`` across file boundaries (``.batch(G)``), with
    the ``shard`` method that ``AutoShardPolicy.FILE`` needs (the files ``index::num_shards``)."""

    def __init__(self, paths: list[Path], parse: Callable[[str], Any], batch_size: int):
        self.paths, self.parse, self.batch_size = list(paths), parse, batch_size

    def shard(self, num_shards: int, index: int) -> TextLineFiles:
        return TextLineFiles(self.paths[index::num_shards], self.parse, self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        rows: list[Any] = []
        for path in self.paths:
            for line in path.read_text().splitlines():
                rows.append(self.parse(line))
                if len(rows) == self.batch_size:
                    yield _stack(rows)
                    rows = []
        if rows:
            yield _stack(rows)


def _stack(rows: list[Any]) -> Any:
    if isinstance(rows[0], tuple):
        return tuple(torch.stack(column) for column in zip(*rows, strict=True))
    return torch.stack(rows)


def to_number(line: str) -> torch.Tensor:
    """``tf.strings.to_number(line, tf.int64)``."""
    return torch.tensor(int(line))


def to_example(line: str) -> tuple[torch.Tensor, torch.Tensor]:
    values = [float(v) for v in line.split(",")]
    return torch.tensor(values[:FEATURES]), torch.tensor(values[FEATURES:])


def worker_rows(policy: str, worker: int) -> list[int]:
    """The example indices worker ``worker`` reads, in order, under ``policy`` (``off``: its
    own share, every other example; ``file``: its files; ``function``: its input pipeline's
    share, as the dataset function below shards)."""
    total = sum(TRAIN_FILE_ROWS)
    if policy == "file":
        starts = [sum(TRAIN_FILE_ROWS[:k]) for k in range(len(TRAIN_FILE_ROWS))]
        return [i for k in range(worker, len(TRAIN_FILE_ROWS), 2)
                for i in range(starts[k], starts[k] + TRAIN_FILE_ROWS[k])]
    return list(range(worker, total, 2))


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1)


def section_runner(result: dict[str, Any]) -> Callable[[str, Callable[[], Any]], None]:
    def run(name: str, body: Callable[[], Any]) -> None:
        try:
            result[name] = body()
        except Exception as error:  # noqa: BLE001 - reported to the test, which asserts on it
            result[name] = {"error": type(error).__name__, "message": str(error),
                            "trace": traceback.format_exc()[-1500:]}
    return run


# -- the job ---------------------------------------------------------------------------------


def main() -> None:
    data_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    result: dict[str, Any] = {}
    section = section_runner(result)

    # Distributed training guide, cell 18: NCCL asked for on CPU workers (TensorFlow warns and
    # uses its ring; this library refuses, before any rendezvous).
    def cell_18() -> dict[str, Any]:
        communication_options = td.experimental.CommunicationOptions(
            implementation=td.experimental.CommunicationImplementation.NCCL)
        strategy = td.MultiWorkerMirroredStrategy(communication_options=communication_options)
        return {"replicas": strategy.num_replicas_in_sync}

    section("dt_cell_18", cell_18)

    # Distributed training guide, cell 16.
    strategy = td.MultiWorkerMirroredStrategy()
    rank = strategy.extended.worker_index
    result["rank"] = rank
    result["dt_cell_16"] = {"replicas": strategy.num_replicas_in_sync,
                            "workers": strategy.extended.num_workers_in_sync,
                            "local_devices": [str(d) for d in strategy.extended.worker_devices]}

    # Distributed input guide, "Sharding": the three policies on 2 workers of 1 replica.
    def with_policy(dataset: Any, policy: td.AutoShardPolicy) -> Any:
        options = td.data.Options()
        options.experimental_distribute.auto_shard_policy = policy
        return td.data.with_options(dataset, options)

    def local_steps(dataset: Any, policy: td.AutoShardPolicy) -> list[list[list[int]]]:
        return [[v.tolist() for v in strategy.experimental_local_results(x)]
                for x in strategy.experimental_distribute_dataset(with_policy(dataset, policy))]

    P = td.data.experimental.AutoShardPolicy
    guide_files = TextLineFiles([data_dir / "f0.txt", data_dir / "f1.txt"], to_number, GLOBAL_BATCH)
    one_file = TextLineFiles([data_dir / "f0.txt"], to_number, GLOBAL_BATCH)
    range12 = DataLoader(torch.arange(12), batch_size=GLOBAL_BATCH)
    for name, dataset, policy in (
        ("OFF range12", range12, P.OFF),
        ("DATA range12", range12, P.DATA),
        ("AUTO range12", range12, P.AUTO),
        ("FILE 2 files", guide_files, P.FILE),
        ("AUTO 2 files", guide_files, P.AUTO),
        ("DATA 2 files", guide_files, P.DATA),
    ):
        section(name, lambda dataset=dataset, policy=policy: local_steps(dataset, policy))

    # 1 vs N: custom loops on 2 workers x 1 replica, compute_average_loss(global_batch_size=G),
    # one per policy; the test trains one process on the same global batches.
    x_all, y_all = examples()

    def train(dataset: Any, policy: td.AutoShardPolicy | None, from_function: bool = False) -> dict[str, Any]:
        with strategy.scope():
            model = make_model()
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            per_example_loss = (model(x) - y).pow(2).squeeze(1)
            loss = td.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return torch.tensor(float(x.shape[0]))

        dist = (strategy.distribute_datasets_from_function(dataset) if from_function
                else strategy.experimental_distribute_dataset(with_policy(dataset, policy)))
        local_rows, global_rows = [], []
        for x, y in dist:
            local_rows.append(int(x.shape[0]))
            global_rows.append(int(strategy.reduce("sum", strategy.run(step, args=(x, y)), axis=None)))
        return {"local_rows": local_rows, "global_rows": global_rows, "params": H.flat(model)}

    def own_loader(policy: str) -> DataLoader:
        rows = worker_rows(policy, rank)
        return DataLoader(TensorDataset(x_all[rows], y_all[rows]), batch_size=GLOBAL_BATCH)

    def shuffled_global_loader() -> DataLoader:
        return DataLoader(TensorDataset(x_all, y_all), batch_size=GLOBAL_BATCH, shuffle=True,
                          generator=torch.Generator().manual_seed(3))

    def dataset_fn(input_context: td.InputContext) -> DataLoader:
        batch_size = input_context.get_per_replica_batch_size(GLOBAL_BATCH)
        rows = list(range(input_context.input_pipeline_id, len(x_all), input_context.num_input_pipelines))
        return DataLoader(TensorDataset(x_all[rows], y_all[rows]), batch_size=batch_size)

    examples_files = TextLineFiles(train_files(data_dir), to_example, GLOBAL_BATCH)
    section("train OFF", lambda: train(own_loader("off"), P.OFF))
    section("train FILE", lambda: train(examples_files, P.FILE))
    section("train DATA", lambda: train(shuffled_global_loader(), P.DATA))
    section("train from_function", lambda: train(dataset_fn, None, from_function=True))

    # 1 vs N: td.keras fit under OFF (each worker's own share) and FILE.
    def fit(dataset: Any, policy: td.AutoShardPolicy) -> dict[str, Any]:
        with strategy.scope():
            model = td.keras.Model(make_model())
        model.compile(td.keras.optimizers.SGD(learning_rate=LR), "mse")
        history = model.fit(with_policy(dataset, policy), epochs=2, verbose=0)
        return {"loss": history.history["loss"], "params": H.flat(model)}

    section("fit OFF", lambda: fit(own_loader("off"), P.OFF))
    section("fit FILE", lambda: fit(examples_files, P.FILE))

    # Distributed input guide, AutoShardPolicy.FILE (and AUTO, which picks it) with fewer files
    # than workers: an error on every worker. Last: the workers must be in step afterwards.
    section("FILE 1 file", lambda: local_steps(one_file, P.FILE))
    section("AUTO 1 file", lambda: local_steps(one_file, P.AUTO))
    section("after the errors", lambda: float(strategy.reduce("sum", strategy.run(lambda: torch.tensor(1.0 + rank)), axis=None)))
    H.emit(result)


if __name__ == "__main__":
    main()
