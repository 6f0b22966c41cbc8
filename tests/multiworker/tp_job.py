"""One worker of the tensor-parallel test job; prints one ``TPRESULT {json}`` line.

    python tp_job.py DIRECTORY [--timeout S] [--sections a,b,...]

Four workers. The first strategy (mesh (2, 2)) comes from the launcher's environment; every
later one adopts its process group, so one job tries several meshes and layouts in turn.
Every section runs on every worker and adds its findings to the result; an exception in a
section is recorded instead of ending the job. Sections, in order:

- ``memory`` (first: peak memory is a process's lifetime high): a 128 MiB stack of
  ``nn.Linear`` split (2, 2) trains 1 step under an address-space limit of 0.6 x its
  whole training state; each worker's growth in resident memory;
- ``train``, ``sequence``, ``torch_plan``: the GPT trained on (2, 2) with per-dimension
  layouts, with sequence parallelism, and with torch's own plan; ``mesh14``, ``mesh41``:
  per-dimension layouts on (1, 4) and (4, 1);
- ``semantics``: replicas, reduce/gather, metrics and dataset splitting on (2, 2);
- ``keras``: ``td.keras.Model.fit`` on (2, 2); ``bf16``: ``MixedPrecisionPolicy``;
- ``checkpoint``: 3 steps on (2, 2) saved, restored on (4, 1) and on (1, 4) (what each
  worker read counted) and trained 2 more steps;
- ``hf``: transformers' Llama with a layout map written for it (skipped without it);
- ``mismatch``: worker 3 with another layout, then another mesh: named errors everywhere.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import resource
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tp_model as M  # noqa: E402

import torch_distribute as td  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("directory")
parser.add_argument("--timeout", type=float, default=60)
parser.add_argument("--sections", default="")
args = parser.parse_args()
wanted = set(args.sections.split(",")) if args.sections else None

torch.set_num_threads(1)
OPTIONS = td.CommunicationOptions(timeout_seconds=args.timeout)
MIB = 2 ** 20


def make_strategy(shape: tuple[int, int], kind: str = "megatron", **kwargs) -> td.FullyShardedStrategy:
    mesh = td.DeviceMesh(shape, ("data", "model"))
    layout_map = td.LayoutMap(mesh)
    for key, layout in M.layouts(kind).items():
        layout_map[key] = layout
    return td.FullyShardedStrategy(layout_map=layout_map, communication_options=OPTIONS, **kwargs)


def encode(tensor: torch.Tensor) -> str:
    """The chief's values in full; the other workers' as a digest of them, compared with the
    digest of the chief's."""
    text = M.encode(tensor)
    return text if rank == 0 else "sha256:" + hashlib.sha256(text.encode()).hexdigest()


T_START = time.monotonic()
BASE_RSS_KIB = M.vm_kib("VmRSS")
first = make_strategy((2, 2))
rank = first.extended.worker_index


def section(name):
    def wrap(fn):
        if wanted is not None and name not in wanted:
            return fn
        started = time.monotonic()
        line: dict = {"rank": rank, "section": name}
        try:
            line["value"] = fn()
        except Exception as error:  # noqa: BLE001 - reported to the test
            line["error"] = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
        line["seconds"] = round(time.monotonic() - started, 2)
        M.emit(line)  # one line per section: the launcher cuts lines at 1 MiB
        if isinstance(line.get("error"), str) and line["error"].startswith("WorkerUnavailableError"):
            os._exit(1)
        return fn
    return wrap


def holdings(model: torch.nn.Module) -> dict:
    params = list(model.parameters())
    return {
        "placements": {n: str(p.placements) for n, p in model.named_parameters()},
        "local_numel": sum(p.to_local().numel() for p in params),
        "whole_numel": sum(p.numel() for p in params),
    }


def report(got: dict, strategy: td.FullyShardedStrategy) -> dict:
    return {"init": encode(got["init"]), "params": encode(got["params"]), "losses": got["losses"],
            "replicas": strategy.num_replicas_in_sync, "replica_id": strategy.extended.replica_id_offset,
            **holdings(got["model"])}


STACK_WIDTH, STACK_DEPTH = 2048, 8  # 8 x 4.2M float32 parameters (bias included): 128 MiB


@section("memory")
def _memory():
    mesh = td.DeviceMesh((2, 2), ("data", "model"))
    layout_map = td.LayoutMap(mesh)  # Megatron pairs: even layers split their outputs, odd ones their inputs
    layout_map[r"[02468]\.weight"] = ("model", None)
    layout_map[r"[13579]\.weight"] = (None, "model")
    strategy = td.FullyShardedStrategy(layout_map=layout_map, communication_options=OPTIONS)
    state_bytes = 4 * STACK_DEPTH * (STACK_WIDTH * STACK_WIDTH + STACK_WIDTH) * 4  # params, grads, 2 x Adam
    # Large blocks go back to the system when freed (glibc would raise its threshold and keep
    # them), so that the address-space limit below bounds what is held, not what was held.
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    libc.mallopt(-8, 2)  # M_ARENA_MAX: no new 64 MiB arena reservations for new threads
    limit = M.vm_kib("VmSize") * 1024 + int(0.6 * state_bytes)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    before = M.vm_kib("VmRSS")
    torch.manual_seed(M.SEED)
    with strategy.scope():
        model = torch.nn.Sequential(*(torch.nn.Linear(STACK_WIDTH, STACK_WIDTH) for _ in range(STACK_DEPTH)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    built = M.vm_kib("VmHWM")
    for _ in range(1):  # the first step makes the gradients and both of Adam's moments
        def step(x):
            loss = td.compute_average_loss(model(x).square().mean(dim=1), global_batch_size=4)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        strategy.run(step, args=(torch.ones(2, STACK_WIDTH),))
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    return {"state_bytes": state_bytes, "peak_growth_bytes": (M.vm_kib("VmHWM") - before) * 1024,
            "build_growth_bytes": (built - before) * 1024,
            "base_peak_bytes": (M.vm_kib("VmHWM") - BASE_RSS_KIB) * 1024,
            "local_numel": sum(p.to_local().numel() for p in model.parameters())}


M_SECTIONS = {"train": ((2, 2), "megatron"), "sequence": ((2, 2), "sequence"), "torch_plan": ((2, 2), "torch"),
              "mesh14": ((1, 4), "megatron"), "mesh41": ((4, 1), "megatron")}
for _name, (_shape, _kind) in M_SECTIONS.items():
    @section(_name)
    def _train(shape=_shape, kind=_kind):
        strategy = first if (shape, kind) == ((2, 2), "megatron") else make_strategy(shape, kind)
        return report(M.train(strategy), strategy)


@section("semantics")
def _semantics():
    strategy = first
    # A global batch of 4 rows: replica 0 (workers 0 and 1) reads rows 0-1, replica 1 rows 2-3.
    dataset = strategy.experimental_distribute_dataset([torch.arange(4.0).reshape(4, 1)])
    batch = next(iter(dataset))
    with strategy.scope():
        metric = td.metrics.Sum()

    def replica_step(x):
        ctx = td.get_replica_context()
        metric.update_state(x.reshape(-1))
        return x.sum(), torch.tensor(float(ctx.replica_id_in_sync_group)), ctx.all_reduce(td.ReduceOp.SUM, x.sum())

    total, ids, all_reduced = strategy.run(replica_step, args=(batch,))
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor([float(ctx.replica_id_in_sync_group)]))
    local = strategy.experimental_local_results
    return {
        "replicas": strategy.num_replicas_in_sync, "replica": strategy.extended.replica_id_offset,
        "id": float(local(ids)[0]), "rows": local(batch)[0].reshape(-1).tolist(),
        "sum": float(strategy.reduce(td.ReduceOp.SUM, total, axis=None)),
        "mean": float(strategy.reduce(td.ReduceOp.MEAN, total, axis=None)),
        "mean_axis0": float(strategy.reduce(td.ReduceOp.MEAN, batch, axis=0)),
        "gather": strategy.gather(per_replica, axis=0).tolist(),
        "gather_rows": strategy.gather(batch, axis=0).reshape(-1).tolist(),
        "all_reduce": float(local(all_reduced)[0]),
        "metric": float(metric.result()),
        "input_pipelines": [strategy.extended.num_input_pipelines, strategy.extended.input_pipeline_id],
    }


@section("keras")
def _keras():
    torch.manual_seed(M.SEED)
    with first.scope():
        model = td.keras.Model(M.GPT())
    model.compile(td.keras.optimizers.AdamW(learning_rate=M.LR, epsilon=M.EPS, weight_decay=0.01),
                  td.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = M.keras_data()
    history = model.fit(x, y, batch_size=M.GLOBAL_BATCH, epochs=2, verbose=0, shuffle=False)
    return {"params": encode(M.flat(model)), "loss": history.history["loss"]}


@section("bf16")
def _bf16():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    strategy = make_strategy((2, 2), mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                          reduce_dtype=torch.float32))
    got = M.train(strategy)
    return {"losses": got["losses"], "params": encode(got["params"]),
            "dtypes": sorted({str(p.dtype) for p in got["model"].parameters()})}


def _count_reads():
    """Elements each DCP read brings in, summed (test instrumentation)."""
    import torch.distributed.checkpoint as dcp

    counted = {"elements": 0}
    original = dcp.FileSystemReader.read_data

    def read_data(self, plan, planner):
        for item in plan.items:
            counted["elements"] += int(torch.Size(item.lengths).numel())
        return original(self, plan, planner)

    dcp.FileSystemReader.read_data = read_data
    return counted, lambda: setattr(dcp.FileSystemReader, "read_data", original)


@section("checkpoint")
def _checkpoint():
    saved = M.train(first, steps=3)
    checkpoint = td.Checkpoint(model=saved["model"], optimizer=saved["optimizer"])
    path = checkpoint.save(os.path.join(args.directory, "ckpt"))
    out = {"saved": path, "whole_numel": int(saved["params"].numel())}
    for shape in ((4, 1), (1, 4)):
        strategy = make_strategy(shape)
        torch.manual_seed(M.SEED + 1)  # other initial values: the restore must replace them
        with strategy.scope():
            model = M.GPT()
            optimizer = M.make_optimizer(model.parameters())
        counted, undo = _count_reads()
        try:
            td.Checkpoint(model=model, optimizer=optimizer).restore(path).assert_consumed()
        finally:
            undo()
        got = M.train(strategy, steps=2, model=model, optimizer=optimizer, first_step=3)
        out[f"{shape[0]}{shape[1]}"] = {"params": encode(got["params"]), "losses": got["losses"],
                                        "read_elements": counted["elements"],
                                        "state_types": sorted({type(v).__name__ for s in optimizer.state.values()
                                                               for v in s.values()})}
    return out


@section("hf")
def _hf():
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"skipped": "transformers is not installed"}
    strategy = td.FullyShardedStrategy(layout_map=M.llama_layout_map(td.DeviceMesh((2, 2), ("data", "model"))),
                                       communication_options=OPTIONS)
    got = M.train_llama(strategy)
    return {"losses": got["losses"], "params": encode(got["params"]), **holdings(got["model"])}


@section("mismatch")
def _mismatch():
    out = {}
    kind = "torch" if rank == 3 else "megatron"  # worker 3 splits the head differently
    strategy = make_strategy((2, 2), kind)
    try:
        with strategy.scope():
            model = M.GPT()
            M.make_optimizer(model.parameters())
        out["layout"] = "no error"
    except td.DistributeError as error:
        out["layout"] = f"{type(error).__name__}: {error}"
    try:
        make_strategy((2, 2) if rank != 3 else (1, 4))
        out["mesh"] = "no error"
    except td.DistributeError as error:
        out["mesh"] = f"{type(error).__name__}: {error}"
    return out


M.emit({"rank": rank, "section": "total", "value": round(time.monotonic() - T_START, 2)})
