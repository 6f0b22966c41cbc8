"""Where a ``MirroredStrategy`` step spends its time (a diagnostic, not part of ``make bench``).

Trains the seed CNN under ``td.MirroredStrategy(["cpu:0", "cpu:1"])`` and stamps the wall
clock at the phases of every step: the dataset split, the hand-off to the replica threads,
each replica's forward and backward, the serial merge of ``optimizer.step()`` (gradient sum
into copy 0, the optimizer, the broadcast), the wake-up of the replicas, ``strategy.reduce``.
Prints the median of each phase over the steps. At a tiny global batch (``--batch 2``) the
compute vanishes and what is left is the strategy's fixed cost per step.

It wraps private methods of ``torch_distribute.strategies.replica_threads.ReplicaThreads``
(``_run``, ``_merge``, ``merge_call``); phases whose hook is missing are reported as n/a.

Run: ``python benchmarks/profile_mirrored.py [--batch 128 --steps 60]``.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Cycle, global_batches, load_average, make_model, make_optimizer, timed  # noqa: E402

EVENTS: dict[str, list[float]] = collections.defaultdict(list)


def _stamp(name: str) -> None:
    EVENTS[name].append(time.perf_counter())


def _wrap(cls: type, name: str, before: str, after: str, with_replica_id: bool = False) -> None:
    original = getattr(cls, name, None)
    if original is None:
        return

    def wrapper(self, *args, **kwargs):
        suffix = str(args[0]) if with_replica_id else ""
        _stamp(before + suffix)
        try:
            return original(self, *args, **kwargs)
        finally:
            _stamp(after + suffix)

    setattr(cls, name, wrapper)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128, help="global batch")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)

    import torch_distribute as td
    from torch_distribute.strategies import replica_threads

    threads_cls = replica_threads.ReplicaThreads
    _wrap(threads_cls, "_run", "run_start", "run_end")
    _wrap(threads_cls, "_merge", "merge_fn_start", "merge_fn_end")
    _wrap(threads_cls, "merge_call", "merge_enter", "merge_exit", with_replica_id=True)

    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = make_model()
        optimizer = make_optimizer(model)
    batch_size = args.batch

    def train_step(batch):
        k = td.get_replica_context().replica_id_in_sync_group
        _stamp(f"fn_start{k}")
        images, labels = batch
        logits = model(images)
        loss = td.compute_average_loss(
            F.cross_entropy(logits, labels, reduction="none"), global_batch_size=batch_size
        )
        _stamp(f"fwd_end{k}")
        loss.backward()
        _stamp(f"bwd_end{k}")
        optimizer.step()
        optimizer.zero_grad()
        _stamp(f"fn_end{k}")
        return loss

    dataset = Cycle(strategy.experimental_distribute_dataset(global_batches(batch_size)))

    def loop(n: int) -> None:
        for _ in range(n):
            _stamp("loop_top")
            batch = next(dataset)
            _stamp("data_done")
            per_replica = strategy.run(train_step, args=(batch,))
            _stamp("run_returned")
            strategy.reduce("sum", per_replica, axis=None)
            _stamp("reduce_done")

    loop(10)
    EVENTS.clear()
    seconds = timed(loop, args.steps)
    e = EVENTS

    def gap(end: str, start: str):
        return lambda i: e[end][i] - e[start][i]

    def last(*names: str):
        return lambda i: max(e[n][i] for n in names)

    phases = [
        ("dataset: split the global batch", gap("data_done", "loop_top")),
        ("hand-off: run() entered -> last replica starts fn",
         lambda i: last("fn_start0", "fn_start1")(i) - e["run_start"][i]),
        ("replica 0 forward (+ loss)", gap("fwd_end0", "fn_start0")),
        ("replica 1 forward (+ loss)", gap("fwd_end1", "fn_start1")),
        ("replica 0 backward", gap("bwd_end0", "fwd_end0")),
        ("replica 1 backward", gap("bwd_end1", "fwd_end1")),
        ("last merge_call -> merge fn starts",
         lambda i: e["merge_fn_start"][i] - last("merge_enter0", "merge_enter1")(i)),
        ("merge fn (grad sum + optimizer + broadcast), serial",
         gap("merge_fn_end", "merge_fn_start")),
        ("merge fn end -> last replica resumes",
         lambda i: last("merge_exit0", "merge_exit1")(i) - e["merge_fn_end"][i]),
        ("zero_grad + return (slower replica)",
         lambda i: max(e["fn_end0"][i] - e["merge_exit0"][i], e["fn_end1"][i] - e["merge_exit1"][i])),
        ("last fn end -> run() returns (+ buffer sync)",
         lambda i: e["run_returned"][i] - last("fn_end0", "fn_end1")(i)),
        ("strategy.reduce", gap("reduce_done", "run_returned")),
        ("whole step", gap("reduce_done", "loop_top")),
    ]
    print(f"MirroredStrategy x2 CPU replicas, global batch {batch_size}: "
          f"{seconds / args.steps * 1e3:.2f} ms/step over {args.steps} steps "
          f"(load average {load_average()}); median per phase:")
    for name, f in phases:
        try:
            value = f"{statistics.median(f(i) for i in range(args.steps)) * 1e3:8.3f} ms"
        except (KeyError, IndexError):
            value = "     n/a   "
        print(f"  {value}  {name}")


if __name__ == "__main__":
    main()
