"""A ParameterServerStrategy job for the tests: every task runs this script (TF_CONFIG).

Scenarios (``--scenario``, repeatable: they run in order on one strategy and coordinator):
``count``, ``worker_failure``, ``ps_failure``, ``checkpoint``, ``user_error``. The chief prints
one JSON line ``RESULT {...}`` per scenario, with its name under ``"scenario"``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import torch
from torch import nn

import torch_distribute as td


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros((), dtype=torch.int64))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(13, 4)
        self.linear = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.linear(self.embedding(ids)).squeeze(-1)


def twos():
    return [torch.tensor(2)] * 10


def add_next(counter, iterator):
    counter.total += next(iterator)
    return counter.total.clone()


def batches(ctx):
    generator = torch.Generator().manual_seed(ctx.input_pipeline_id)
    while True:
        ids = torch.randint(0, 13, (8,), generator=generator)
        yield ids, (ids.float() / 13.0)


def train_step(model, optimizer, counter, iterator, marker):
    index = td.coordinator.experimental_get_current_worker_index()
    if marker and index == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)  # this worker dies in the middle of a step
    ids, target = next(iterator)
    loss = (model(ids) - target).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    counter.steps += 1
    time.sleep(0.02)
    return loss


def fail(x):
    raise ValueError(f"bad input {x}")


def slow(x):
    time.sleep(0.2)
    return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", required=True, action="append")
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    _record_pid(args.dir)
    if td.distribute_server(rpc_timeout=20, chief_timeout=15):
        return
    partitioner = td.partitioners.FixedShardsPartitioner(5) if "checkpoint" in args.scenario else None
    strategy = td.ParameterServerStrategy(variable_partitioner=partitioner, rpc_timeout=20, startup_timeout=90)
    coordinator = td.coordinator.ClusterCoordinator(strategy)
    for scenario in args.scenario:
        result = globals()[f"scenario_{scenario}"](strategy, coordinator, args.dir)
        print("RESULT " + json.dumps({"scenario": scenario, **result}), flush=True)


def scenario_count(strategy, coordinator, directory):
    with strategy.scope():
        counter = Counter()
    iterator = iter(coordinator.create_per_worker_dataset(twos))
    values = [coordinator.schedule(add_next, args=(counter, iterator)) for _ in range(5)]
    coordinator.join()
    first = int(counter.state_dict()["total"])
    for _ in range(5):
        values.append(coordinator.schedule(add_next, args=(counter, iterator)))
    coordinator.join()
    return {"first": first, "second": int(counter.state_dict()["total"]), "done": coordinator.done(),
            "fetched": sorted(int(v) for v in coordinator.fetch(values))}


def _model(strategy):
    with strategy.scope():
        torch.manual_seed(0)
        model = Net()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        counter = Counter()
    return model, optimizer, counter


def scenario_worker_failure(strategy, coordinator, directory):
    model, optimizer, counter = _model(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(batches))
    marker = os.path.join(directory, "killed")
    losses = [coordinator.schedule(train_step, args=(model, optimizer, counter, iterator, marker))
              for _ in range(30)]
    coordinator.join()
    phase1 = int(counter.state_dict()["steps"])
    stats1 = coordinator.worker_stats
    # The restarted worker 1 rejoins: it takes work again.
    deadline = time.monotonic() + 90
    while not coordinator._dispatchers[1].available and time.monotonic() < deadline:
        time.sleep(0.2)
    losses2 = [coordinator.schedule(train_step, args=(model, optimizer, counter, iterator, marker))
               for _ in range(30)]
    coordinator.join()
    stats2 = coordinator.worker_stats
    return {"killed": os.path.exists(marker), "phase1_steps": phase1,
            "steps": int(counter.state_dict()["steps"]), "fetched": len(coordinator.fetch(losses + losses2)),
            "worker1_after_restart": stats2["worker:1"] - stats1["worker:1"],
            "rejoined_as": coordinator._dispatchers[1].name}


def _record_pid(directory: str) -> None:
    """Write this task's process id where ``_task_pid`` finds it (a restarted task's replaces it)."""
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    path = os.path.join(directory, f"pid-{task['type']}-{task['index']}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def _task_pid(directory: str, task_type: str, index: int) -> int:
    """The process of this job's task ``task_type:index``, as it recorded: only the library's
    entry points can be called remotely, so it is found locally."""
    with open(os.path.join(directory, f"pid-{task_type}-{index}")) as f:
        return int(f.read())


def scenario_ps_failure(strategy, coordinator, directory):
    model, optimizer, counter = _model(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(batches))
    for _ in range(4):
        coordinator.schedule(train_step, args=(model, optimizer, counter, iterator, ""))
    coordinator.join()
    os.kill(_task_pid(directory, "ps", 1), signal.SIGKILL)
    start = time.monotonic()
    try:
        for _ in range(50):
            coordinator.schedule(train_step, args=(model, optimizer, counter, iterator, ""))
        coordinator.join()
        return {"raised": None}
    except td.ParameterServerUnavailableError as error:
        again = None
        try:
            coordinator.done()
        except td.ParameterServerUnavailableError:
            again = True
        return {"raised": type(error).__name__, "message": str(error), "seconds": time.monotonic() - start,
                "raised_again": again}


def scenario_checkpoint(strategy, coordinator, directory):
    model, optimizer, counter = _model(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(batches))
    for _ in range(12):
        coordinator.schedule(train_step, args=(model, optimizer, counter, iterator, ""))
    coordinator.join()
    ckpt = td.Checkpoint(model=model, optimizer=optimizer)
    path = ckpt.save(os.path.join(directory, "ckpt"))
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
               os.path.join(directory, "reference.pt"))
    # Restore on the coordinator after more training: the servers get the saved values back.
    for _ in range(4):
        coordinator.schedule(train_step, args=(model, optimizer, counter, iterator, ""))
    coordinator.join()
    changed = not torch.equal(model.state_dict()["embedding.weight"],
                              torch.load(os.path.join(directory, "reference.pt"))["model"]["embedding.weight"])
    ckpt.restore(path)
    coordinator.schedule(slow, args=(0,)).fetch()  # a round trip through the servers
    model.linear.weight.data.add_(0)  # no-op edit: nothing to send
    restored = {k: v.tolist() for k, v in model.state_dict().items()}
    return {"path": path, "changed_before_restore": changed, "restored": restored,
            "shards": [len(strategy.extended.registry.spec_of(p).shards) for p in model.parameters()]}


def scenario_user_error(strategy, coordinator, directory):
    queued = [coordinator.schedule(slow, args=(i,)) for i in range(2)]
    bad = coordinator.schedule(fail, args=(7,))
    later = [coordinator.schedule(slow, args=(i,)) for i in range(20)]
    out = {}
    try:
        coordinator.join()
    except ValueError as error:
        out["join_raised"] = str(error)
    statuses = []
    for value in later:
        try:
            value.fetch()
            statuses.append("ok")
        except td.ClosureCancelledError:
            statuses.append("cancelled")
    out["later"] = statuses
    out["queued"] = [v.fetch() for v in queued]
    try:
        bad.fetch()
    except ValueError:
        out["bad_fetch_raised"] = True
    out["after"] = coordinator.schedule(slow, args=(5,)).fetch()
    out["done"] = coordinator.done()
    lock = threading.Lock()
    try:  # a lambda travels by value, but not the lock it captures
        coordinator.schedule(lambda: lock.locked())
    except td.InvalidArgumentError as error:
        out["lambda_rejected"] = "`lock`" in str(error)
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
