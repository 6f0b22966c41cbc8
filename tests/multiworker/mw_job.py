"""One worker of a multi-worker test job; prints one ``MWRESULT {json}`` line.

    python mw_job.py --replicas R [--epochs E] [--checks] [--save-dir D] [--restore PATH]

Started once per worker (by the launcher, or with a TF_CONFIG each). Every section runs on
every worker (they all take part in the collectives) and adds its findings to the result;
an exception in a section is recorded instead of ending the job, so one broken property
does not hide the others (a broken collective still ends it within ``--timeout``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mw_helpers as H  # noqa: E402

import torch_distribute as td  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--replicas", type=int, default=1)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--timeout", type=float, default=30)
parser.add_argument("--checks", action="store_true", help="semantics, sharding, ragged input")
parser.add_argument("--save-dir", default=None)
parser.add_argument("--restore", default=None)
args = parser.parse_args()

torch.set_num_threads(1)
SUM, MEAN = td.ReduceOp.SUM, td.ReduceOp.MEAN

T_START = time.monotonic()
strategy = td.MultiWorkerMirroredStrategy(
    devices=[f"cpu:{i}" for i in range(args.replicas)],
    communication_options=td.CommunicationOptions(timeout_seconds=args.timeout))
resolver = strategy.cluster_resolver
rank = resolver.worker_index
result: dict = {"rank": rank, "errors": {}, "seconds": {"strategy": time.monotonic() - T_START}}


def section(name):
    """Run the decorated function at once, on every worker; record its result or its error."""
    def wrap(fn):
        started = time.monotonic()
        try:
            result[name] = fn()
            result["seconds"][name] = time.monotonic() - started
        except Exception as error:  # noqa: BLE001 - reported to the test
            result["errors"][name] = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
            if isinstance(error, td.WorkerUnavailableError):
                H.emit(result)
                os._exit(1)
        return fn
    return wrap


@section("topology")
def _topology():
    ext = strategy.extended
    return {
        "num_replicas_in_sync": strategy.num_replicas_in_sync,
        "num_local": len(ext.worker_devices),
        "is_chief": ext.is_chief,
        "should_checkpoint": ext.should_checkpoint,
        "should_save_summary": ext.should_save_summary,
        "task_type": resolver.task_type,
        "task_id": resolver.task_id,
        "num_workers": resolver.num_workers,
        "env_rank": os.environ.get("RANK"),
        "tf_config": "TF_CONFIG" in os.environ,
    }


# -- training (equivalence) -------------------------------------------------------------
torch.manual_seed(H.worker_seed(rank))
with strategy.scope():
    model = H.make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=H.LR)
    loss_metric = td.metrics.Mean()


@section("train")
def _train():
    init = H.flat(model)
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
        loss_metric.update_state(per_example.detach())
        return loss

    losses, steps_per_epoch = [], []
    for _ in range(args.epochs):
        steps = 0
        for batch in dist_ds:
            per_replica = strategy.run(step, args=(batch, sizes[steps]))
            losses.append(float(strategy.reduce(SUM, per_replica, axis=None)))
            steps += 1
        steps_per_epoch.append(steps)
    # Every local copy must be identical to the logical model too.
    copies = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]).tolist()
              for m in strategy.experimental_local_results(model)]
    return {"init": init, "params": H.flat(model), "copies": copies, "losses": losses,
            "steps_per_epoch": steps_per_epoch, "metric": float(loss_metric.result())}


if args.save_dir:
    @section("save")
    def _save():
        # Every worker calls save, each with its own directory (the tutorial's pattern): each
        # gets its own copy, as in TensorFlow. Once in the training loop's context (outside
        # any scope, as the tutorial does) and once inside strategy.scope().
        ckpt = td.Checkpoint(model=model, optimizer=optimizer, metric=loss_metric)
        outside = ckpt.save(os.path.join(args.save_dir, "outside", f"w{rank}", "ckpt"))
        with strategy.scope():
            inside = ckpt.save(os.path.join(args.save_dir, "inside", f"w{rank}", "ckpt"))
        return {"outside": outside, "inside": inside, "metric": float(loss_metric.result())}


if args.restore:
    @section("restore")
    def _restore():
        torch.manual_seed(H.worker_seed(rank) + 7)
        with strategy.scope():
            restored_model = H.make_model()
            restored_optimizer = torch.optim.Adam(restored_model.parameters(), lr=H.LR)
            restored_metric = td.metrics.Mean()
        ckpt = td.Checkpoint(model=restored_model, optimizer=restored_optimizer, metric=restored_metric)
        ckpt.restore(args.restore).assert_consumed()
        copies = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]).tolist()
                  for m in strategy.experimental_local_results(restored_model)]
        steps = sorted({int(s["step"]) for s in restored_optimizer.state_dict()["state"].values()})
        return {"params": H.flat(restored_model), "copies": copies,
                "metric": float(restored_metric.result()), "adam_steps": steps}


# -- cross-replica / replica-context semantics ---------------------------------------------
if args.checks:
    class iter_batches:  # noqa: N801 - an iterable without __len__, like a generator
        def __init__(self, batches):
            self._batches = batches

        def __iter__(self):
            return iter(self._batches)

    def _rid() -> int:
        return td.get_replica_context().replica_id_in_sync_group

    def _local(value):
        return [v.tolist() if isinstance(v, torch.Tensor) else v
                for v in strategy.experimental_local_results(value)]

    @section("semantics")
    def _semantics():
        out = {}
        out["ids"] = _local(strategy.run(_rid))
        out["nums"] = _local(strategy.run(lambda: td.get_replica_context().num_replicas_in_sync))
        out["value_fn_ids"] = _local(strategy.experimental_distribute_values_from_function(
            lambda ctx: torch.tensor(ctx.replica_id_in_sync_group)))
        a = strategy.run(lambda: torch.tensor([_rid() + 1.0, (_rid() + 1.0) ** 2]))
        out["sum"] = strategy.reduce(SUM, a, axis=None).tolist()
        out["mean"] = strategy.reduce(MEAN, a, axis=None).tolist()
        out["sum_a_axis0"] = strategy.reduce(SUM, a, axis=0).tolist()
        # Uneven per-replica sizes: replica i has i + 1 rows [i, 10 i].
        b = strategy.run(lambda: torch.tensor([[float(_rid()), 10.0 * _rid()]] * (_rid() + 1)))
        out["sum_axis0"] = strategy.reduce(SUM, b, axis=0).tolist()
        out["mean_axis0"] = strategy.reduce(MEAN, b, axis=0).tolist()
        out["gather"] = strategy.gather(b, axis=0).tolist()

        # Replica-context collectives, one run each (a failure is reported per operation).
        def replica_op(name, fn):
            def wrapped():
                value = fn(td.get_replica_context())
                return type(value).__name__, value

            try:
                kinds, values = strategy.run(wrapped)
                out[name] = {"types": sorted(set(_local(kinds))), "values": _local(values)}
            except Exception as error:  # noqa: BLE001
                if isinstance(error, td.WorkerUnavailableError):
                    raise
                out[name] = {"error": f"{type(error).__name__}: {error}"}

        def grad_of_all_reduce(ctx):
            x = torch.tensor(ctx.replica_id_in_sync_group + 1.0, requires_grad=True)
            ctx.all_reduce(SUM, x * x).backward()
            return x.grad

        replica_op("all_reduce_sum", lambda ctx: ctx.all_reduce(
            SUM, torch.tensor(ctx.replica_id_in_sync_group + 1.0)))
        replica_op("all_reduce_mean", lambda ctx: ctx.all_reduce(
            MEAN, torch.tensor([ctx.replica_id_in_sync_group + 1.0, 2.0 * ctx.replica_id_in_sync_group])))
        replica_op("all_gather", lambda ctx: ctx.all_gather(
            torch.full((ctx.replica_id_in_sync_group + 1,), float(ctx.replica_id_in_sync_group)), axis=0))
        replica_op("merge_call", lambda ctx: ctx.merge_call(
            lambda s, v: s.reduce(SUM, v, axis=None),
            args=(torch.tensor(float(ctx.replica_id_in_sync_group)),)))
        replica_op("all_reduce_grad", grad_of_all_reduce)
        return out

    @section("sharding")
    def _sharding():
        data = torch.arange(23)
        batches = [(data[i:i + 7].double().unsqueeze(1), data[i:i + 7]) for i in range(0, 23, 7)]
        with strategy.scope():
            mean = td.metrics.Mean()

        def step(batch):
            values, idx = batch
            mean.update_state(values.squeeze(1))
            return idx

        rows, gathered = [], []
        for batch in strategy.experimental_distribute_dataset(batches):
            rows.append(_local(batch[1]))
            gathered.append(strategy.gather(strategy.run(step, args=(batch,)), axis=0).tolist())
        contexts = []
        strategy.distribute_datasets_from_function(
            lambda ctx: contexts.append(
                [ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync]) or [data[:2]])
        return {"rows": rows, "gathered": gathered, "mean": float(mean.result()),
                "input_context": contexts[0]}

    @section("ragged_off")
    def _ragged_off():
        # Each worker reads its own batches (OFF), global batches of 3 rows as TensorFlow has
        # it: worker w has 3 - 2 w of them (at least one), with ids unique over the job; each
        # makes one step per worker; the short worker runs out first.
        num_workers = resolver.num_workers
        counts = [max(1, 3 - 2 * w) for w in range(num_workers)]
        start = sum(counts[:rank]) * 3
        mine = [torch.arange(start + 3 * k, start + 3 * k + 3) for k in range(counts[rank])]
        options = td.InputOptions(auto_shard_policy=td.AutoShardPolicy.OFF)
        dist_ds = strategy.experimental_distribute_dataset(iter_batches(mine), options=options)
        torch.manual_seed(0)
        with strategy.scope():
            lin = torch.nn.Linear(1, 1)
            sgd = torch.optim.SGD(lin.parameters(), lr=0.1)

        def step(idx):
            loss = td.compute_average_loss(lin(idx.float().unsqueeze(1)).squeeze(1), global_batch_size=3)
            loss.backward()
            sgd.step()
            sgd.zero_grad()
            return torch.tensor(float(idx.shape[0]))

        rows, counted = [], []
        for idx in dist_ds:
            rows.append(_local(idx))
            counted.append(float(strategy.reduce(SUM, strategy.run(step, args=(idx,)), axis=None)))
        return {"rows": rows, "counted": counted, "lin": H.flat(lin)}


H.emit(result)
