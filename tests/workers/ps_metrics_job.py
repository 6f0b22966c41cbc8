"""ParameterServerStrategy job for tests/test_ps_metrics.py and tests/test_ps_shards.py.

Every task runs this script (TF_CONFIG). Scenarios (``--scenario``): ``metrics`` (the
tutorial's training accuracy and distributed evaluation), ``worker_failure`` (a worker dies
in the middle of a function that updated metrics), ``shards`` (a FixedShardsPartitioner(2)
parameter of shape (8, 16384)). The chief prints one JSON line ``RESULT {...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
from torch import nn

import torch_distribute as td

STEPS = 24
EVAL_STEPS = 12


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 4, generator=generator)
    return x, torch.randint(0, 3, (8,), generator=generator)


def noisy_predictions(labels: torch.Tensor, step: int) -> torch.Tensor:
    """Predictions right except for the first two samples of every third step."""
    pred = labels.clone()
    if step % 3 == 0:
        pred[:2] = (pred[:2] + 1) % 3
    return pred


def train_step(strategy, model, optimizer, train_accuracy, top2, accuracy, mean, step):
    x, labels = batch(step)

    def replica_fn(x, labels):
        loss = nn.functional.cross_entropy(model(x), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        # As in the tutorial: metrics updated inside the replica function.
        train_accuracy.update_state(labels, nn.functional.one_hot(labels, 3).float())
        top2.update_state(labels, nn.functional.one_hot(labels, 3).float())
        accuracy.update_state(labels, noisy_predictions(labels, step))
        mean.update_state(torch.tensor(float(step)))
        return loss

    return strategy.run(replica_fn, args=(x, labels))


def eval_step(strategy, model, eval_accuracy, step):
    x, labels = batch(1000 + step)

    def replica_fn(x, labels):
        eval_accuracy.update_state(labels, model(x).argmax(-1))

    strategy.run(replica_fn, args=(x, labels))


def reference(steps: int) -> tuple[float, float]:
    """The single-process values of ``accuracy`` and ``mean`` over ``steps`` steps."""
    accuracy, mean = td.metrics.Accuracy(), td.metrics.Mean()
    for step in range(steps):
        _, labels = batch(step)
        accuracy.update_state(labels, noisy_predictions(labels, step))
        mean.update_state(torch.tensor(float(step)))
    return float(accuracy.result()), float(mean.result())


def wait_until_every_worker_runs(coordinator, timeout_s: float = 60.0) -> None:
    """Schedule short functions until every worker has run one: a worker whose interpreter
    started later than the other's (a loaded machine) would otherwise find the queue empty."""
    deadline = time.monotonic() + timeout_s
    while not all(coordinator.worker_stats.values()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every worker ran a function in {timeout_s:g} s: {coordinator.worker_stats}")
        for _ in range(len(coordinator.worker_stats)):
            coordinator.schedule(time.sleep, args=(0.05,))
        coordinator.join()


def scenario_metrics(strategy, coordinator, directory):
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train_accuracy = td.metrics.SparseCategoricalAccuracy()
        top2 = td.keras.metrics.SparseTopKCategoricalAccuracy(k=2)
        accuracy = td.metrics.Accuracy()
        mean = td.metrics.Mean()
        eval_accuracy = td.metrics.Accuracy()
    out = {}
    args = (strategy, model, optimizer, train_accuracy, top2, accuracy, mean)
    wait_until_every_worker_runs(coordinator)
    before = coordinator.worker_stats
    for step in range(STEPS):
        coordinator.schedule(train_step, args=(*args, step))
    coordinator.join()
    out["workers_used"] = sorted(k for k, v in coordinator.worker_stats.items() if v > before[k])
    out["train_accuracy"] = float(train_accuracy.result())
    out["top2"], out["top2_count"] = float(top2.result()), float(top2.state_dict()["count"])
    out["accuracy"], out["mean"] = float(accuracy.result()), float(mean.result())
    out["reference_accuracy"], out["reference_mean"] = reference(STEPS)
    out["mean_state"] = {k: float(v) for k, v in mean.state_dict().items()}

    # reset_state on the coordinator (the tutorial resets per epoch), then a shorter epoch.
    for metric in (train_accuracy, accuracy, mean):
        metric.reset_state()
    out["after_reset"] = [float(train_accuracy.result()), float(accuracy.result()), float(mean.result())]
    for step in range(6):
        coordinator.schedule(train_step, args=(*args, step))
    coordinator.join()
    out["second_epoch"] = [float(train_accuracy.result()), float(accuracy.result()), float(mean.result())]
    out["reference_second"] = list(reference(6))

    # The tutorial's distributed evaluation: the model is not trained any more, so the
    # coordinator can compute the single-process value with its own (refreshed) module.
    for step in range(EVAL_STEPS):
        coordinator.schedule(eval_step, args=(strategy, model, eval_accuracy, step))
    coordinator.join()
    local = td.metrics.Accuracy()
    with torch.no_grad():
        for step in range(EVAL_STEPS):
            x, labels = batch(1000 + step)
            local.update_state(labels, model(x).argmax(-1))
    out["eval_accuracy"], out["reference_eval"] = float(eval_accuracy.result()), float(local.result())

    # state_dict / load_state_dict go to the servers, and a worker sees the loaded state.
    mean.load_state_dict({"total": torch.tensor(10.0), "count": torch.tensor(4.0)})
    out["loaded_mean"] = float(mean.result())
    out["worker_sees"] = float(coordinator.schedule(read_result, args=(mean,)).fetch())
    try:
        coordinator.schedule(reset_on_worker, args=(mean,)).fetch()
    except td.InvalidArgumentError as error:
        out["reset_on_worker"] = str(error)
    try:
        import torchmetrics

        with strategy.scope():
            td.metrics.TorchMetric(torchmetrics.MeanSquaredError())
    except td.InvalidArgumentError as error:
        out["torchmetric"] = str(error)
    return out


def read_result(metric):
    return metric.result()


def reset_on_worker(metric):
    metric.reset_state()


def dying_step(model, optimizer, total, count, step, marker, flush_first):
    """Updates the metrics, then (once, on any worker) dies before the function ends."""
    x, labels = batch(step)
    total.update_state(torch.tensor(float(step)))
    count.update_state(torch.tensor(1.0))
    if flush_first:  # optimizer.step() then a forward: the updates so far are sent early
        nn.functional.cross_entropy(model(x), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
        model(x)
    if not os.path.exists(marker):  # the first run of any step kills its worker
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return step


def scenario_worker_failure(strategy, coordinator, directory):
    with strategy.scope():
        model = nn.Linear(4, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        total, count = td.metrics.Sum(), td.metrics.Sum()
    out = {}
    for flush_first in (False, True):
        marker = os.path.join(directory, f"killed-{flush_first}")
        values = [coordinator.schedule(dying_step, args=(model, optimizer, total, count, step, marker, flush_first))
                  for step in range(STEPS)]
        coordinator.join()
        out[f"killed_{flush_first}"] = os.path.exists(marker)
        out[f"fetched_{flush_first}"] = sorted(coordinator.fetch(values))
        out[f"total_{flush_first}"], out[f"count_{flush_first}"] = float(total.result()), float(count.result())
        total.reset_state()
        count.reset_state()
    return out


def scenario_shards(strategy, coordinator, directory):
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Linear(16384, 8)  # weight (8, 16384): two shards of 4 rows
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    coordinator.schedule(shard_step, args=(model, optimizer)).fetch()
    coordinator.join()
    view = strategy.sharded_variable(model.weight)
    shards = [{"shape": list(s.shape), "offset": list(s.offset), "ps_task": s.ps_task, "device": s.device}
              for s in view.variables]
    weight = model.state_dict()["weight"]  # the coordinator's view, refreshed
    values = [s.read_value() for s in view]
    out = {"shards": shards, "shape": list(view.shape), "len": len(view),
           "concat_equals_parameter": bool(torch.equal(torch.cat(values), weight)),
           "read_value_equals_parameter": bool(torch.equal(view.read_value(), weight)),
           "trained": not torch.equal(weight, torch.load(os.path.join(directory, "init.pt"))),
           "bias": [list(s.shape) for s in strategy.sharded_variable(model.bias)],
           "names": {k: len(v) for k, v in strategy.sharded_variables(model).items()}}
    try:
        strategy.sharded_variable(torch.zeros(3))
    except td.InvalidArgumentError as error:
        out["outside_scope"] = str(error)
    return out


def shard_step(model, optimizer):
    generator = torch.Generator().manual_seed(0)
    model(torch.randn(2, 16384, generator=generator)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    if td.distribute_server(rpc_timeout=20, chief_timeout=15):
        return
    partitioner = td.partitioners.FixedShardsPartitioner(2) if args.scenario == "shards" else None
    strategy = td.ParameterServerStrategy(variable_partitioner=partitioner, rpc_timeout=20, startup_timeout=90)
    coordinator = td.coordinator.ClusterCoordinator(strategy)
    if args.scenario == "shards":
        torch.manual_seed(0)
        torch.save(nn.Linear(16384, 8).weight.detach().clone(), os.path.join(args.dir, "init.pt"))
    result = globals()[f"scenario_{args.scenario}"](strategy, coordinator, args.dir)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
