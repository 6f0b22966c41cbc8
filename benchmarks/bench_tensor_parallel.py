"""(t) ``td.FullyShardedStrategy`` with a ``LayoutMap`` vs hand-written ``parallelize_module`` +
``fully_shard`` on the same 2-D mesh, and the memory per worker of each mesh shape.

The GPT of ``examples/gpt_tensor_parallel.py`` (imported from there: same model, same data,
same layout) with ``LAYERS`` blocks of width ``WIDTH`` and ``SEQ_LEN`` characters of context,
AdamW, global batch ``GLOBAL_BATCH``, 4 worker processes per variant (gloo on loopback, one
thread each), for each mesh shape in ``--meshes`` (default (2, 2), (1, 4), (4, 1)). Both
variants of a mesh are kept alive and driven in alternating rounds
(``common.measure_interleaved``); figures are medians over rounds, ratios medians of the
per-round ratios.

* ``ours``: ``td.FullyShardedStrategy(layout_map=gpt_tensor_parallel.layout_map(mesh))``
  from torchrun's variables; model and optimizer made in its scope (never whole on a worker),
  ``experimental_distribute_dataset``, ``strategy.run`` of the step with
  ``td.compute_average_loss``, ``strategy.reduce("sum", ...)`` of the loss.
* ``hand``: no ``torch_distribute`` object: ``dist.init_process_group("gloo")``,
  ``init_device_mesh("cpu", (data, model), ("data", "model"))``, the whole model built on
  every rank (same seed), torch's ``parallelize_module`` with the plan our layout map gives
  (``ColwiseParallel`` for q/k/v, the MLP's first layer and the head, whose logits are
  gathered; ``RowwiseParallel`` for the attention's projection and the MLP's second layer),
  then ``fully_shard`` on every block and the root over ``mesh["data"]`` with
  ``reshard_after_forward=True`` (as ours), gradients summed (``set_gradient_divide_factor(1.0)``,
  ``set_force_sum_reduction_for_comms(True)``), the loss ``sum / GLOBAL_BATCH`` over the
  rank's rows, one ``all_reduce`` of the logged loss over the data axis per step.

After the timed steps the parameters of both are gathered and compared (the same
collectives and arithmetic: equal within 1e-5 expected). Memory per worker: parameters +
optimizer state held (local shards) against the whole model, and peak RSS less the RSS
before the model was built (the hand-written variant builds the whole model on every rank
first, as ``parallelize_module`` scripts usually do; ours never does).

Run: ``python benchmarks/bench_tensor_parallel.py [--quick] [--meshes 2,2 1,4]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import (  # noqa: E402
    Cycle,
    Trainer,
    Variant,
    VariantProcess,
    emit,
    free_port,
    init_gloo,
    load_average,
    machine_line,
    max_abs_diff,
    measure_interleaved,
    median_ratio,
)

NUM_WORKERS = 4
GLOBAL_BATCH = 16
LAYERS = 4
WIDTH = 256
SEQ_LEN = 128
LR = 1e-3
SEED = 1234
NUM_BATCHES = 16
GOAL = 0.97


def _args() -> argparse.Namespace:
    return argparse.Namespace(seq_len=SEQ_LEN, width=WIDTH, layers=LAYERS)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _Worker(Variant):
    def __init__(self, rank: int, mesh: tuple[int, int], port: int):
        self.rank, self.mesh_shape, self.port = rank, mesh, port

    def setup(self) -> None:
        import torch.distributed.fsdp  # noqa: F401
        import torch.distributed.tensor.parallel  # noqa: F401

        from examples.gpt_fully_sharded import CharData, load_text, make_batches

        self.data = CharData(load_text())
        self.batches = make_batches(self.data.train, NUM_BATCHES, GLOBAL_BATCH, SEQ_LEN, SEED)
        self.rss_before_build = _rss_bytes()
        super().setup()

    def _model(self) -> torch.nn.Module:
        from examples.gpt_tensor_parallel import make_model

        torch.manual_seed(SEED)
        return make_model(self.data.vocab_size, _args())

    def params(self) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor

        from examples.gpt_fully_sharded import state_bytes

        local, whole = state_bytes(self.trainer.model, self.optimizer)
        peak = _peak_rss_bytes()
        full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().to("cpu", copy=True)
                for n, p in self.trainer.model.named_parameters()}
        return {"params": full if self.rank == 0 else {},
                "memory": {"local_bytes": local, "whole_bytes": whole, "peak_rss": peak,
                           "peak_rss_over_start": peak - self.rss_before_build}}


class Ours(_Worker):
    def setup(self) -> None:
        os.environ.pop("TF_CONFIG", None)
        os.environ.update({"RANK": str(self.rank), "WORLD_SIZE": str(NUM_WORKERS), "LOCAL_RANK": str(self.rank),
                           "LOCAL_WORLD_SIZE": str(NUM_WORKERS), "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(self.port)})
        import torch_distribute as td
        from examples.gpt_tensor_parallel import layout_map

        self.strategy = td.FullyShardedStrategy(
            layout_map=layout_map(td.DeviceMesh(self.mesh_shape, ("data", "model"))))
        super().setup()

    def build(self, dtype: torch.dtype) -> Trainer:
        import torch_distribute as td
        from examples.gpt_tensor_parallel import per_window_loss

        strategy = self.strategy
        with strategy.scope():
            model = self._model()
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
        self.optimizer = optimizer
        it = Cycle(strategy.experimental_distribute_dataset(self.batches))
        total = torch.zeros(())

        def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            loss = td.compute_average_loss(per_window_loss(model, *batch), global_batch_size=GLOBAL_BATCH)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        def run_steps(n: int) -> None:
            nonlocal total
            for _ in range(n):
                total += strategy.reduce("sum", strategy.run(train_step, args=(next(it),)), axis=None)

        return Trainer(run_steps, model)

    def close(self) -> None:
        self.strategy.extended.worker_group.close()


class Hand(_Worker):
    def setup(self) -> None:
        self.dist = init_gloo(self.port, self.rank, NUM_WORKERS)
        super().setup()

    def build(self, dtype: torch.dtype) -> Trainer:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        from examples.gpt_tensor_parallel import per_window_loss

        dist = self.dist
        mesh = init_device_mesh("cpu", self.mesh_shape, mesh_dim_names=("data", "model"))
        model = self._model()  # whole on every rank, same seed: same values
        plan = {"head": ColwiseParallel(output_layouts=Replicate())}
        for i in range(len(model.blocks)):
            for name in ("attn.q", "attn.k", "attn.v", "mlp.up"):
                plan[f"blocks.{i}.{name}"] = ColwiseParallel()
            for name in ("attn.proj", "mlp.down"):
                plan[f"blocks.{i}.{name}"] = RowwiseParallel()
        parallelize_module(model, mesh["model"], plan)
        for block in model.blocks:
            fully_shard(block, mesh=mesh["data"])
        fully_shard(model, mesh=mesh["data"], reshard_after_forward=True)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
        self.optimizer = optimizer
        data_rank, data_size = mesh["data"].get_local_rank(), self.mesh_shape[0]
        local = GLOBAL_BATCH // data_size
        lo, hi = data_rank * local, (data_rank + 1) * local
        it = Cycle([(x[lo:hi], y[lo:hi]) for x, y in self.batches])
        data_group = mesh["data"].get_group()
        total = torch.zeros(())

        def run_steps(n: int) -> None:
            nonlocal total
            for _ in range(n):
                loss = per_window_loss(model, *next(it)).sum() / GLOBAL_BATCH
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                logged = loss.detach().clone()
                dist.all_reduce(logged, group=data_group)
                total += logged

        return Trainer(run_steps, model)

    def close(self) -> None:
        self.dist.destroy_process_group()


class Group(VariantProcess):
    def __init__(self, name: str, make_variant: Any, mesh: tuple[int, int]):
        port = free_port()
        super().__init__(name, make_variant, [(rank, mesh, port) for rank in range(NUM_WORKERS)], num_threads=1)

    def report_all(self) -> list[dict[str, Any]]:
        self._send("params")
        return self._replies()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", nargs="+", default=["2,2", "1,4", "4,1"])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="few rounds: a smoke test, not figures")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 1, 1
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU and gloo, whatever the machine has
    print(f"# (t) tensor parallelism: FullyShardedStrategy(layout_map) vs hand-written parallelize_module + "
          f"fully_shard, {NUM_WORKERS} gloo processes x 1 thread; GPT {LAYERS} layers, width {WIDTH}, "
          f"context {SEQ_LEN}, global batch {GLOBAL_BATCH}, AdamW")
    print(f"# {machine_line()}")
    meshes = {}
    mib = 2 ** 20
    for text in args.meshes:
        shape = tuple(int(n) for n in text.split(","))
        assert len(shape) == 2 and shape[0] * shape[1] == NUM_WORKERS, text
        groups: list[Group] = []
        try:
            groups = [Group("ours", Ours, shape), Group("hand", Hand, shape)]
            per_step = measure_interleaved(groups, args.steps, args.rounds, args.warmup)
            reports = {g.name: g.report_all() for g in groups}
        finally:
            for g in groups:
                try:
                    g.stop()
                except Exception as error:  # noqa: BLE001 - stop() kills the processes anyway
                    print(f"# stopping {g.name}: {error}", file=sys.stderr)
        ratio = median_ratio(per_step["hand"], per_step["ours"])  # throughput ours / hand
        diff = max_abs_diff(reports["ours"][0]["params"], reports["hand"][0]["params"])
        entry = {"s_per_step": {n: statistics.median(v) for n, v in per_step.items()},
                 "rounds_s_per_step": per_step, "throughput_ours_over_hand": ratio,
                 "param_max_abs_diff": diff, "memory": {n: [r["memory"] for r in reports[n]] for n in reports}}
        meshes[text] = entry
        print(f"mesh ({text}): ours {entry['s_per_step']['ours'] * 1e3:.1f} ms/step, hand "
              f"{entry['s_per_step']['hand'] * 1e3:.1f} ms/step, throughput ours / hand {ratio:.3f} "
              f"(goal >= {GOAL}); params max abs diff {diff:.1e}")
        for name, memory in entry["memory"].items():
            held = ", ".join(f"{m['local_bytes'] / mib:.2f}" for m in memory)
            peaks = ", ".join(f"{m['peak_rss_over_start'] / mib:.0f}" for m in memory)
            print(f"    {name:>4} per worker: state {held} of {memory[0]['whole_bytes'] / mib:.2f} MiB; "
                  f"peak RSS over start {peaks} MiB")
    print(f"# load average at the end: {load_average()}")
    result = {"bench": "tensor_parallel", "torch": torch.__version__, "workers": NUM_WORKERS,
              "global_batch": GLOBAL_BATCH, "model": {"layers": LAYERS, "width": WIDTH, "seq_len": SEQ_LEN},
              "rounds": args.rounds, "steps": args.steps, "meshes": meshes}
    emit(result)
    if any(m["param_max_abs_diff"] > 1e-5 for m in meshes.values()):
        print("ERROR: FullyShardedStrategy(layout_map) did not train like the hand-written loop", file=sys.stderr)
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
