"""One worker of a ``FullyShardedStrategy`` test job; prints one ``FSRESULT {json}`` line.

    python fs_job.py [--timeout S] [--mesh R,S] [--bf16] [--checks] [--compiled] [--keras] [--no-train]

Started once per worker (by the launcher, or with a TF_CONFIG each). Every section runs on
every worker (they all take part in the collectives) and adds its findings to the result;
an exception in a section is recorded instead of ending the job, so one broken property
does not hide the others (a broken collective still ends it within ``--timeout``).

Sections: ``topology``; ``train`` (unless ``--no-train``; the tiny transformer, AdamW, ragged last batch: losses,
whole parameters, what this worker holds and whether it is sharded); with ``--checks``
``semantics`` (reduce, gather, replica-context collectives, metrics across workers); with
``--compiled`` ``compiled`` (the same training, ``@td.function`` on the distributed step);
with ``--keras`` ``keras`` (``td.keras.Model.fit``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fs_model as M  # noqa: E402

import torch_distribute as td  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--timeout", type=float, default=60)
parser.add_argument("--mesh", default=None, help="replicate,shard")
parser.add_argument("--bf16", action="store_true", help="MixedPrecisionPolicy(bf16 params, fp32 reduce)")
parser.add_argument("--checks", action="store_true")
parser.add_argument("--compiled", action="store_true")
parser.add_argument("--keras", action="store_true")
parser.add_argument("--no-train", action="store_true", help="skip the eager training section")
args = parser.parse_args()

torch.set_num_threads(1)
SUM, MEAN = td.ReduceOp.SUM, td.ReduceOp.MEAN

T_START = time.monotonic()
kwargs = {}
if args.mesh:
    kwargs["mesh_shape"] = tuple(int(n) for n in args.mesh.split(","))
if args.bf16:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    kwargs["mixed_precision"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
strategy = td.FullyShardedStrategy(
    communication_options=td.CommunicationOptions(timeout_seconds=args.timeout), **kwargs)
resolver = strategy.cluster_resolver
rank = strategy.extended.worker_index
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
                M.emit(result)
                os._exit(1)
        return fn
    return wrap


def _nbytes(tensor: torch.Tensor, local: bool) -> int:
    """Bytes of ``tensor``: this worker's shard (``local``) or the whole value."""
    if isinstance(tensor, torch.distributed.tensor.DTensor):
        part = tensor.to_local() if local else tensor
        return part.numel() * part.element_size()
    return tensor.numel() * tensor.element_size()


def _holdings(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """What this worker holds of the parameters and of the optimizer state, and how."""
    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    return {
        "param_types": sorted({type(p).__name__ for p in params}),
        "placements": sorted({repr(tuple(p.placements)) for p in params if hasattr(p, "placements")}),
        "mesh_shape": sorted({tuple(p.device_mesh.shape) for p in params if hasattr(p, "device_mesh")}),
        "param_dtypes": sorted({str(p.dtype) for p in params}),
        "state_dtypes": sorted({str(v.dtype) for v in states}),
        "state_types": sorted({type(v).__name__ for v in states}),
        # The optimizer updates the model's own sharded parameters, every one of them once.
        "optimizer_params_are_model_params": len(opt_params) == len(params)
        and all(a is b for a, b in zip(opt_params, params, strict=True)),
        "local_param_numel": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params),
        "whole_param_numel": sum(p.numel() for p in params),
        "local_bytes": sum(_nbytes(t, True) for t in [*params, *states]),
        "whole_bytes": sum(_nbytes(t, False) for t in [*params, *states]),
        "num_state_tensors": len(states),
        "grads_none": all(p.grad is None for p in params),
    }


def _summary(trained: dict) -> dict:
    return {"init": M.encode(trained["init"]), "params": M.encode(trained["params"]),
            **{k: trained[k] for k in ("losses", "metric", "steps_per_epoch")}}


@section("topology")
def _topology():
    ext = strategy.extended
    return {
        "num_replicas_in_sync": strategy.num_replicas_in_sync,
        "num_workers": ext.num_workers_in_sync,
        "is_chief": ext.is_chief,
        "should_checkpoint": ext.should_checkpoint,
        "mesh_shape": list(ext.mesh.shape),
        "mesh_dim_names": list(ext.mesh.mesh_dim_names or ()),
        "resolver": type(resolver).__name__,
    }


if not args.no_train:
    @section("train")
    def _train():
        trained = M.train(strategy, seed=M.worker_seed(rank))
        return {**_summary(trained), **_holdings(trained["model"], trained["optimizer"])}


if args.checks:
    def _rid() -> int:
        return td.get_replica_context().replica_id_in_sync_group

    @section("semantics")
    def _semantics():
        out = {}
        out["ids"] = int(strategy.run(_rid))
        a = strategy.run(lambda: torch.tensor([_rid() + 1.0, (_rid() + 1.0) ** 2]))
        out["sum"] = strategy.reduce(SUM, a, axis=None).tolist()
        out["mean"] = strategy.reduce(MEAN, a, axis=None).tolist()
        # Uneven sizes: worker i has i + 1 rows [i, 10 i].
        b = strategy.run(lambda: torch.tensor([[float(_rid()), 10.0 * _rid()]] * (_rid() + 1)))
        out["sum_axis0"] = strategy.reduce(SUM, b, axis=0).tolist()
        out["mean_axis0"] = strategy.reduce(MEAN, b, axis=0).tolist()
        out["gather"] = strategy.gather(b, axis=0).tolist()

        def replica(fn):
            return strategy.run(lambda: fn(td.get_replica_context()))

        out["all_reduce_sum"] = replica(lambda ctx: ctx.all_reduce(
            SUM, torch.tensor(ctx.replica_id_in_sync_group + 1.0))).tolist()
        out["all_reduce_mean"] = replica(lambda ctx: ctx.all_reduce(
            MEAN, torch.tensor([ctx.replica_id_in_sync_group + 1.0, 2.0 * ctx.replica_id_in_sync_group]))).tolist()
        out["all_gather"] = replica(lambda ctx: ctx.all_gather(
            torch.full((ctx.replica_id_in_sync_group + 1,), float(ctx.replica_id_in_sync_group)), axis=0)).tolist()
        out["merge_call"] = replica(lambda ctx: ctx.merge_call(
            lambda s, v: s.reduce(SUM, v, axis=None),
            args=(torch.tensor(float(ctx.replica_id_in_sync_group)),))).tolist()

        def grad_of_all_reduce(ctx):
            x = torch.tensor(ctx.replica_id_in_sync_group + 1.0, requires_grad=True)
            ctx.all_reduce(SUM, x * x).backward()
            return x.grad

        out["all_reduce_grad"] = replica(grad_of_all_reduce).tolist()
        # Metrics made in the scope: worker i sees the values 10 i, ..., 10 i + i.
        with strategy.scope():
            mean, total = td.metrics.Mean(), td.metrics.Sum()
            accuracy = td.metrics.SparseCategoricalAccuracy()

        def update():
            values = torch.tensor([10.0 * _rid() + k for k in range(_rid() + 1)])
            mean.update_state(values)
            total.update_state(values)
            # Worker i: i + 1 rows, the first one right.
            logits = torch.tensor([[1.0, 0.0]] * (_rid() + 1))
            labels = torch.tensor([0] + [1] * _rid())
            accuracy.update_state(labels, logits)
            return mean.result()  # inside run: the global value too, through merge_call

        out["metric_in_run"] = float(strategy.run(update))
        out["metric_mean"] = float(mean.result())
        out["metric_sum"] = float(total.result())
        out["metric_accuracy"] = float(accuracy.result())
        return out


if args.compiled:
    @section("compiled")
    def _compiled():
        functions = []

        def wrap(fn):
            functions.append(td.function(fn))
            return functions[-1]

        trained = M.train(strategy, seed=M.worker_seed(rank), wrap_step=wrap)
        return {**_summary(trained),
                "tracing_count": functions[0].experimental_get_tracing_count(),
                "param_types": sorted({type(p).__name__ for p in trained["model"].parameters()})}


if args.keras:
    @section("keras")
    def _keras():
        torch.manual_seed(M.worker_seed(rank))
        with strategy.scope():
            model = td.keras.Model(M.make_model())
        model.compile(td.keras.optimizers.Adam(learning_rate=M.LR),
                      td.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        x, y = M.make_data(M.KERAS_SAMPLES)
        history = model.fit(x, y, batch_size=M.GLOBAL_BATCH, epochs=M.KERAS_EPOCHS, verbose=0,
                            validation_data=(x[:19], y[:19]))  # last batches: 3 rows
        return {"params": M.encode(M.flat(model)), "history": history.history,
                "evaluate": model.evaluate(x, y, batch_size=10, verbose=0),
                "predict": M.encode(model.predict(x[:7], batch_size=4, verbose=0)),
                "param_types": sorted({type(p).__name__ for p in model.parameters()})}


result["seconds"]["total"] = time.monotonic() - T_START
M.emit(result)
