"""(e) ``td.FullyShardedStrategy`` vs hand-written FSDP2 vs ``td.MultiWorkerMirroredStrategy``.

The GPT of ``examples/gpt_fully_sharded.py`` (imported from there: same model, same data) at
a moderate size (``LAYERS`` blocks of width ``WIDTH``, ``SEQ_LEN`` characters of context,
about 3.2M parameters), AdamW, global batch ``GLOBAL_BATCH`` windows, 2 worker processes per
variant, gloo on loopback, ``torch.set_num_threads(1)`` in each. Every variant starts from
the same initial weights (seeded; the strategies broadcast the chief's) and trains on the
same global batches, each worker on its half. Each pair of processes is kept alive for the
whole benchmark and the pairs are driven in alternating rounds
(``common.measure_interleaved``); figures are medians over rounds, ratios medians of the
per-round ratios.

* ``ours``: ``td.FullyShardedStrategy()`` from torchrun's variables; model and optimizer made
  in its scope, the default shard policy (every block of the ModuleList, then the root); global batches through ``experimental_distribute_dataset``; ``strategy.run`` of the
  step with ``td.compute_average_loss(..., global_batch_size=GLOBAL_BATCH)``, then
  ``strategy.reduce("sum", ...)`` of the loss (the global loss a loop logs).
* ``FSDP2``: hand-written, no ``torch_distribute`` object anywhere:
  ``dist.init_process_group("gloo")``, ``fully_shard(block)`` for every block then
  ``fully_shard(model)`` with torch's defaults (``reshard_after_forward=None``: the root keeps
  its parameters gathered from forward to backward), ``set_gradient_divide_factor(1.0)`` and
  ``set_force_sum_reduction_for_comms(True)`` (gradients summed, as ours; gloo has no
  pre-scaled sum), the loss ``sum / GLOBAL_BATCH`` over the rank's half batch, and one
  ``dist.all_reduce`` of the detached loss per step (the same logging collective).
* ``FSDP2-reshard-all``: the same with ``reshard_after_forward=True`` for the root too, which
  is what ``FullyShardedStrategy`` passes: it isolates the strategy's own overhead from that
  choice.
* ``ours-unchecked``: ours with ``CommunicationOptions(verify_collectives=False)``: no
  fingerprint exchange before each sharded forward and optimizer step (``ours / this`` is the
  cost of those checks).
* ``MWMS``: ``td.MultiWorkerMirroredStrategy()`` with the same step (data parallel: every
  worker holds the whole model and optimizer state).

The hand-written processes import the example module for the model and data (which imports
``torch_distribute``, but makes no strategy: they check that none of its torch hooks is
installed). After the timed steps, the parameters of every variant are gathered
(``full_tensor``) and compared with ours: the hand-written FSDP2 variants run the very same
collectives and arithmetic, so bitwise equality is expected; MWMS sums the gradients another
way (float32 rounding).

Memory, per worker: the bytes of the parameters + optimizer state it holds (a DTensor's local
shard; plain tensors whole) and the process's peak RSS (``ru_maxrss``), also less the RSS
before the model was built (after the imports and the data, alike in every variant).

CPU only: where CUDA is available, the worker processes are started with
``CUDA_VISIBLE_DEVICES=""`` so every variant runs on the CPU with gloo (a one-GPU machine
cannot hold two NCCL ranks; the GPU case is not measured here).

Run: ``python benchmarks/bench_fully_sharded.py [--quick]`` (``--quick``: a smoke test).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # the repository root: ``examples`` is a package

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
    relative_l2_diff,
)

NUM_WORKERS = 2
GLOBAL_BATCH = 16
LAYERS = 4
WIDTH = 256
HEADS = 8
SEQ_LEN = 128
LR = 1e-3
SEED = 1234
NUM_BATCHES = 32  # distinct global batches, cycled
GOAL_OURS_OVER_FSDP2 = 0.97


def _model_args() -> argparse.Namespace:
    return argparse.Namespace(seq_len=SEQ_LEN, width=WIDTH, layers=LAYERS, heads=HEADS)


def _data() -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    from examples.gpt_fully_sharded import CharData, load_text, make_batches

    data = CharData(load_text())
    return data, make_batches(data.train, NUM_BATCHES, GLOBAL_BATCH, SEQ_LEN, SEED)


def _make_model(vocab_size: int) -> torch.nn.Module:
    from examples.gpt_fully_sharded import make_model

    torch.manual_seed(SEED)
    return make_model(vocab_size, _model_args())


def _make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class _Worker(Variant):
    """One rank of a two-process variant; ``params()`` also reports the memory figures."""

    def __init__(self, rank: int, world_size: int, port: int):
        self.rank, self.world_size, self.port = rank, world_size, port

    def setup(self) -> None:
        # Everything but the model and its training imported and loaded before the RSS is read,
        # alike in every variant.
        import torch.distributed.fsdp  # noqa: F401
        import torch.distributed.tensor  # noqa: F401

        import examples.gpt_fully_sharded  # noqa: F401 - imports torch_distribute too

        self.data, self.batches = _data()
        self.rss_before_build = _rss_bytes()
        super().setup()

    def build(self, dtype: torch.dtype) -> Trainer:
        raise NotImplementedError

    def params(self) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor

        from examples.gpt_fully_sharded import state_bytes

        local, whole = state_bytes(self.trainer.model, self.optimizer)
        peak = _peak_rss_bytes()  # before the gathers below
        full = {}
        for name, p in self.trainer.model.named_parameters():  # full_tensor: every rank calls it
            full[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().to("cpu", copy=True)
        return {
            "params": full if self.rank == 0 else {},
            "memory": {"local_bytes": local, "whole_bytes": whole, "peak_rss": peak,
                       "peak_rss_over_start": peak - self.rss_before_build},
        }


def _torchrun_env(rank: int, world_size: int, port: int) -> None:
    os.environ.pop("TF_CONFIG", None)
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })


class _StrategyWorker(_Worker):
    def make_strategy(self) -> Any:
        raise NotImplementedError

    def setup(self) -> None:
        _torchrun_env(self.rank, self.world_size, self.port)
        self.strategy = self.make_strategy()
        assert self.strategy.num_replicas_in_sync == self.world_size, self.strategy.num_replicas_in_sync
        super().setup()

    def build(self, dtype: torch.dtype) -> Trainer:
        import torch_distribute as td
        from examples.gpt_fully_sharded import per_window_loss

        strategy = self.strategy
        data, batches = self.data, self.batches
        with strategy.scope():
            model = _make_model(data.vocab_size)
            optimizer = _make_optimizer(model)
        self.optimizer = optimizer
        it = Cycle(strategy.experimental_distribute_dataset(batches))
        total = torch.zeros(())

        def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            x, y = batch
            loss = td.compute_average_loss(per_window_loss(model, x, y), global_batch_size=GLOBAL_BATCH)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        def run_steps(n: int) -> None:
            nonlocal total
            for _ in range(n):
                total += strategy.reduce("sum", strategy.run(train_step, args=(next(it),)), axis=None)

        return Trainer(run_steps, model)

    def info(self) -> dict[str, Any]:
        return {**super().info(), "strategy": repr(self.strategy)}

    def close(self) -> None:
        self.strategy.extended.worker_group.close()


class Ours(_StrategyWorker):
    def make_strategy(self) -> Any:
        import torch_distribute as td

        # The default policy: every block, then the root, as the hand-written FSDP2 does.
        return td.FullyShardedStrategy()


class OursUnchecked(_StrategyWorker):
    def make_strategy(self) -> Any:
        import torch_distribute as td

        return td.FullyShardedStrategy(communication_options=td.CommunicationOptions(verify_collectives=False))


class MultiWorker(_StrategyWorker):
    def make_strategy(self) -> Any:
        import torch_distribute as td

        return td.MultiWorkerMirroredStrategy()


class HandFSDP2(_Worker):
    """Hand-written FSDP2; ``reshard_root``: ``None`` (torch's default) or ``True`` (ours)."""

    reshard_root: bool | None = None

    def setup(self) -> None:
        self.dist = init_gloo(self.port, self.rank, self.world_size)
        super().setup()

    def build(self, dtype: torch.dtype) -> Trainer:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        from examples.gpt_fully_sharded import per_window_loss

        dist = self.dist
        data, batches = self.data, self.batches
        mesh = init_device_mesh("cpu", (self.world_size,))
        model = _make_model(data.vocab_size)  # same seed on every rank: same initial values
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh, reshard_after_forward=self.reshard_root)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)  # summed over ranks: loss / global batch
                module.set_force_sum_reduction_for_comms(True)
        optimizer = _make_optimizer(model)
        self.optimizer = optimizer
        local = GLOBAL_BATCH // self.world_size
        lo, hi = self.rank * local, (self.rank + 1) * local
        it = Cycle([(x[lo:hi], y[lo:hi]) for x, y in batches])
        total = torch.zeros(())

        def run_steps(n: int) -> None:
            nonlocal total
            for _ in range(n):
                x, y = next(it)
                loss = per_window_loss(model, x, y).sum() / GLOBAL_BATCH
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                logged = loss.detach().clone()
                dist.all_reduce(logged)
                total += logged

        return Trainer(run_steps, model)

    def info(self) -> dict[str, Any]:
        from torch_distribute.strategies import interception

        # The example module imports torch_distribute; it must have changed nothing in torch.
        assert not interception._installed, "torch_distribute's hooks are installed in a hand-written process"
        return {**super().info(), "reshard_root": self.reshard_root}

    def close(self) -> None:
        self.dist.destroy_process_group()


class HandFSDP2ReshardAll(HandFSDP2):
    reshard_root = True


class WorkerPair(VariantProcess):
    def __init__(self, name: str, make_variant: Any):
        port = free_port()
        super().__init__(name, make_variant, [(rank, NUM_WORKERS, port) for rank in range(NUM_WORKERS)],
                         num_threads=1)

    def report_all(self) -> list[dict[str, Any]]:
        """Every worker's ``{"params", "memory"}`` (rank order; params from rank 0 only)."""
        self._send("params")
        return self._replies()


VARIANTS = {
    "ours": (Ours, "`FullyShardedStrategy()` (default policy: every block, then the root), `strategy.run`"),
    "FSDP2": (HandFSDP2, "hand-written FSDP2 (`fully_shard` blocks + root, torch defaults)"),
    "FSDP2-reshard-all": (HandFSDP2ReshardAll, "hand-written FSDP2, root `reshard_after_forward=True` (as ours)"),
    "ours-unchecked": (OursUnchecked, "ours, `verify_collectives=False` (no fingerprint exchanges)"),
    "MWMS": (MultiWorker, "`MultiWorkerMirroredStrategy()`, `strategy.run`"),
}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=4, help="training steps per variant per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="few rounds: a smoke test, not figures")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 2, 1
    if torch.cuda.is_available():
        print("# CUDA is available but not used: the workers run on the CPU with gloo "
              "(CUDA_VISIBLE_DEVICES='' in the worker processes)")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # inherited by the spawned workers

    print(f"# (e) FullyShardedStrategy vs hand-written FSDP2 vs MultiWorkerMirroredStrategy, "
          f"{NUM_WORKERS} gloo processes x 1 thread each; GPT {LAYERS} layers, width {WIDTH}, "
          f"context {SEQ_LEN}, global batch {GLOBAL_BATCH}, AdamW")
    print(f"# {machine_line()}")
    pairs: list[WorkerPair] = []
    try:
        for name, (cls, _) in VARIANTS.items():
            pairs.append(WorkerPair(name, cls))
        per_step = measure_interleaved(pairs, args.steps, args.rounds, args.warmup)
        reports = {p.name: p.report_all() for p in pairs}
    finally:
        for p in pairs:
            try:
                p.stop()
            except Exception as error:  # noqa: BLE001 - stop() kills the processes anyway
                print(f"# stopping {p.name}: {error}", file=sys.stderr)

    names = list(VARIANTS)
    med = {name: statistics.median(per_step[name]) for name in names}
    ratios = {name: median_ratio(per_step[name], per_step["ours"]) for name in names if name != "ours"}
    n_steps = args.warmup + args.rounds * args.steps
    ours_params = reports["ours"][0]["params"]
    num_params = sum(p.numel() for p in ours_params.values())
    print(f"# {num_params:,} parameters; {n_steps} steps per variant ({args.rounds} rounds of "
          f"{args.steps}, {args.warmup} warm-up)")
    variants = {}
    for name in names:
        memory = [r["memory"] for r in reports[name]]
        params = reports[name][0]["params"]
        diff = 0.0 if name == "ours" else max_abs_diff(params, ours_params)
        rel = 0.0 if name == "ours" else relative_l2_diff(params, ours_params)
        variants[name] = {
            "label": VARIANTS[name][1],
            "s_per_step": med[name],
            "rounds_s_per_step": per_step[name],
            "throughput_ours_over_this": ratios.get(name),
            "local_bytes": [m["local_bytes"] for m in memory],
            "whole_bytes": memory[0]["whole_bytes"],
            "peak_rss": [m["peak_rss"] for m in memory],
            "peak_rss_over_start": [m["peak_rss_over_start"] for m in memory],
            "param_max_abs_diff_vs_ours": diff,
            "param_rel_l2_diff_vs_ours": rel,
        }
        ratio = "" if name == "ours" else f"  ours / this {ratios[name]:.3f}"
        print(f"{name:>18}: {med[name] * 1e3:8.2f} ms/step {1 / med[name]:6.2f} steps/s{ratio}  "
              f"(rounds: {', '.join(f'{t * 1e3:.0f}' for t in per_step[name])})")
    print("per worker: parameters + optimizer state held (MiB) / whole model; peak RSS (MiB), "
          "and peak RSS less the RSS before the model was built:")
    mib = 2**20
    for name, v in variants.items():
        held = ", ".join(f"{b / mib:.2f}" for b in v["local_bytes"])
        print(f"{name:>18}: state {held} / {v['whole_bytes'] / mib:.2f}  "
              f"(ratio {max(v['local_bytes']) / v['whole_bytes']:.3f}); peak RSS "
              f"{', '.join(f'{b / mib:.0f}' for b in v['peak_rss'])}; over start "
              f"{', '.join(f'{b / mib:.0f}' for b in v['peak_rss_over_start'])}")
    print(f"params after {n_steps} steps vs ours, max abs / relative L2: "
          + "; ".join(f"{name} {v['param_max_abs_diff_vs_ours']:.1e} / {v['param_rel_l2_diff_vs_ours']:.1e}"
                      for name, v in variants.items() if name != "ours")
          + "  (FSDP2 variants: 0 expected)")
    print(f"throughput ours / hand-written FSDP2: {ratios['FSDP2']:.3f} (goal >= {GOAL_OURS_OVER_FSDP2}), "
          f"ours / FSDP2-reshard-all: {ratios['FSDP2-reshard-all']:.3f}, ours / MWMS: {ratios['MWMS']:.3f}, "
          f"ours / ours-unchecked: {ratios['ours-unchecked']:.3f} (the fingerprint checks)")
    print(f"# load average at the end: {load_average()}")

    result = {
        "bench": "fully_sharded",
        "torch": torch.__version__,
        "workers": NUM_WORKERS,
        "global_batch": GLOBAL_BATCH,
        "model": {"layers": LAYERS, "width": WIDTH, "heads": HEADS, "seq_len": SEQ_LEN,
                  "parameters": num_params},
        "steps_trained": n_steps,
        "rounds": args.rounds,
        "steps": args.steps,
        "throughput_ratio_ours_over_fsdp2": ratios["FSDP2"],
        "throughput_ratio_ours_over_fsdp2_reshard_all": ratios["FSDP2-reshard-all"],
        "throughput_ratio_ours_over_mwms": ratios["MWMS"],
        "throughput_ratio_ours_over_unchecked": ratios["ours-unchecked"],
        "variants": variants,
    }
    emit(result)
    bad = [name for name in ("FSDP2", "FSDP2-reshard-all", "ours-unchecked")
           if variants[name]["param_max_abs_diff_vs_ours"] > 1e-5]
    if bad:
        print(f"ERROR: FullyShardedStrategy did not train like {', '.join(bad)}", file=sys.stderr)
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
