"""(c) ``td.MultiWorkerMirroredStrategy`` over 2 gloo workers vs raw DDP over 2 gloo processes.

Two worker processes per variant, each with ``torch.set_num_threads(1)``, talking over gloo
on loopback; each pair is kept alive for the whole benchmark and the pairs are driven in
alternating rounds (``common.measure_interleaved``), medians over rounds.

1. Training: the tutorial CNN with Adam, global batch 128 (64 per worker), same initial
   weights and same synthetic global batches for both variants.

   * ``MultiWorkerMirroredStrategy``: each process gets torchrun's environment (``RANK``,
     ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``) and
     builds ``td.MultiWorkerMirroredStrategy()``; model and optimizer are made in its scope;
     ``experimental_distribute_dataset`` of the global batches keeps each worker's 64 rows;
     ``strategy.run(train_step)`` with ``td.compute_average_loss(..., global_batch_size=128)``,
     then ``strategy.reduce("sum", per_replica_loss, axis=None)`` for the global loss.
   * ``DDP``: ``DistributedDataParallel`` on each rank's 64 rows of the same global batch,
     ``F.cross_entropy`` (mean over 64; DDP averages the ranks, so the same gradient), and a
     ``dist.all_reduce`` of the detached loss each step (the same logging collective).

   After the timed steps, the parameters of both MWMS workers must be identical, and are
   compared with DDP's (printed; bitwise equal is expected here, since both sum the same two
   half-batch gradients and differ only by power-of-2 scalings, but in general Adam amplifies
   float32 summation-order noise); then both variants train a fresh float64 copy for a few
   steps, which must agree to 1e-9.

2. All-reduce throughput of the gradient path, for 1, 4 and 16 MiB of float32 gradients
   (a model of four ``Linear(d, d)``, d = 256, 512, 1024; one 25 MiB bucket each):

   * ``ours``: ``strategy.run(step)`` where ``step`` sets every ``.grad`` (preallocated
     tensors, assigned by reference) and calls ``optimizer.step()`` of an optimizer whose
     own update is a no-op (``SGD`` subclass, made in the scope). So the time is exactly what
     the strategy adds to get the global gradient sum into ``.grad``: ``run``'s overhead,
     ``GradientSynchronizer.finish()`` (pack the gradients and the per-parameter flags into
     the bucket, the gloo all-reduce, unpack into ``.grad``) and the post-step bookkeeping.
     No backward runs, so nothing overlaps the communication: this is the full, unhidden
     cost (in training, buckets launched during backward hide part of it).
   * ``bare``: ``dist.all_reduce(flat)`` of a flat float32 tensor of the same number of
     elements (the gradient bytes; ours carries 4 flags more per bucket).
   * ``bare+copies``: the bare all-reduce plus copying the gradients into the flat tensor
     and back, which is what DDP's reducer does by default (``gradient_as_bucket_view=False``):
     the floor for any implementation that packs gradients into buckets.

   The gradients are zeros (sums of zeros stay zeros over many steps; gloo's speed does not
   depend on the values). Reported: GB/s (tensor bytes / time, 1 GB = 1e9 B) and the ratio
   ours / bare (throughput, 1 = as fast as the bare all-reduce).

Run: ``python benchmarks/bench_multi_worker.py [--quick]`` (``--quick``: a smoke test).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    Trainer,
    Variant,
    VariantProcess,
    ddp_trainer,
    emit,
    free_port,
    init_gloo,
    load_average,
    machine_line,
    max_abs_diff,
    measure_interleaved,
    median_ratio,
    relative_l2_diff,
    strategy_trainer,
)

GLOBAL_BATCH = 128
NUM_WORKERS = 2
F64_TOLERANCE = 1e-9
# Widths of the four Linear(d, d) layers: 4 * d * d * 4 bytes = 1, 4, 16 MiB (+ biases).
ALLREDUCE_WIDTHS = (256, 512, 1024)
ALLREDUCE_LAYERS = 4


def _allreduce_model(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(ALLREDUCE_LAYERS)])


def _allreduce_numel(width: int) -> int:
    return ALLREDUCE_LAYERS * (width * width + width)


class _NoUpdate(torch.optim.SGD):
    """SGD whose own update does nothing: times the strategy's gradient path alone."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        return None


class _Worker(Variant):
    """One rank of a two-process variant. ``run_steps`` takes an int (training steps) or
    ``("allreduce", width, n)`` (``n`` gradient all-reduces of the model of that width)."""

    def __init__(self, rank: int, world_size: int, port: int):
        self.rank, self.world_size, self.port = rank, world_size, port
        self._allreduce: dict[int, Any] = {}

    def run_steps(self, value: Any) -> None:
        if isinstance(value, tuple):
            _, width, n = value
            if width not in self._allreduce:
                self._allreduce[width] = self.make_allreduce(width)
            self._allreduce[width](n)
        else:
            self.trainer.run_steps(value)

    def make_allreduce(self, width: int) -> Any:
        raise NotImplementedError



class MultiWorker(_Worker):
    verify_collectives = True  # CommunicationOptions(verify_collectives=...)

    def setup(self) -> None:
        import torch_distribute as td

        os.environ.pop("TF_CONFIG", None)
        os.environ.update({
            "RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.rank),
            "LOCAL_WORLD_SIZE": str(self.world_size), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.port),
        })
        self.strategy = td.MultiWorkerMirroredStrategy(
            communication_options=td.CommunicationOptions(verify_collectives=self.verify_collectives))
        assert self.strategy.num_replicas_in_sync == self.world_size, self.strategy.num_replicas_in_sync
        super().setup()

    def build(self, dtype: torch.dtype) -> Trainer:
        return strategy_trainer(self.strategy, dtype, GLOBAL_BATCH)

    def make_allreduce(self, width: int) -> Any:
        strategy = self.strategy
        with strategy.scope():
            model = _allreduce_model(width)
            optimizer = _NoUpdate(model.parameters(), lr=0.0)
        params = list(model.parameters())
        grads = [torch.zeros_like(p) for p in params]

        def step() -> None:
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            optimizer.step()

        def run(n: int) -> None:
            for _ in range(n):
                strategy.run(step)

        return run

    def info(self) -> dict[str, Any]:
        return {**super().info(), "strategy": repr(self.strategy)}

    def close(self) -> None:
        group = self.strategy.extended.worker_group
        if group is not None:
            group.close()


class DDP(_Worker):
    def setup(self) -> None:
        self.dist = init_gloo(self.port, self.rank, self.world_size)
        super().setup()

    def build(self, dtype: torch.dtype) -> Trainer:
        return ddp_trainer(self.rank, self.world_size, dtype, GLOBAL_BATCH, log_global_loss=True)

    def make_allreduce(self, width: int) -> Any:
        dist = self.dist
        flat = torch.zeros(_allreduce_numel(width))
        grads = [torch.zeros_like(p) for p in _allreduce_model(width).parameters()]
        offsets = [0]
        for g in grads:
            offsets.append(offsets[-1] + g.numel())

        def bare(n: int) -> None:
            for _ in range(n):
                dist.all_reduce(flat)

        def with_copies(n: int) -> None:
            for _ in range(n):
                for g, lo, hi in zip(grads, offsets[:-1], offsets[1:], strict=True):
                    flat[lo:hi].copy_(g.reshape(-1))
                dist.all_reduce(flat)
                for g, lo, hi in zip(grads, offsets[:-1], offsets[1:], strict=True):
                    g.copy_(flat[lo:hi].view_as(g))

        return bare, with_copies

    def run_steps(self, value: Any) -> None:
        if isinstance(value, tuple):
            kind, width, n = value
            if width not in self._allreduce:
                self._allreduce[width] = self.make_allreduce(width)
            bare, with_copies = self._allreduce[width]
            (bare if kind == "bare" else with_copies)(n)
        else:
            self.trainer.run_steps(value)

    def close(self) -> None:
        self.dist.destroy_process_group()


class WorkerPair(VariantProcess):
    def __init__(self, name: str, make_variant: Any):
        port = free_port()
        super().__init__(name, make_variant, [(rank, NUM_WORKERS, port) for rank in range(NUM_WORKERS)],
                         num_threads=1)

    def params_all(self) -> list[dict[str, torch.Tensor]]:
        """Every worker's parameters (rank order)."""
        self._send("params")
        return self._replies()

    def reference_params_all(self, steps: int) -> list[dict[str, torch.Tensor]]:
        self._send("reference_params", steps)
        return self._replies()


def measure_allreduce(
    ours: WorkerPair, ddp: WorkerPair, width: int, iters: int, rounds: int
) -> dict[str, list[float]]:
    """Seconds per all-reduce of ours, bare and bare+copies, interleaved in every round."""
    calls = {
        "ours": (ours, ("allreduce", width)),
        "bare": (ddp, ("bare", width)),
        "bare+copies": (ddp, ("copies", width)),
    }
    for pair, key in calls.values():
        pair.run((*key, max(2, iters // 4)))  # builds the model (ours: chief broadcast) and warms up
    names = list(calls)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            pair, key = calls[name]
            out[name].append(pair.run((*key, iters)) / iters)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=6, help="training steps per variant per round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--check-steps", type=int, default=10, help="steps of the float64 check")
    parser.add_argument("--ar-rounds", type=int, default=9, help="rounds of the all-reduce benchmark")
    parser.add_argument("--ar-mib", type=float, default=64.0,
                        help="MiB all-reduced per variant per round (sets the iterations per size)")
    parser.add_argument("--quick", action="store_true", help="few rounds: a smoke test, not figures")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.check_steps = 3, 5, 2, 3
        args.ar_rounds, args.ar_mib = 3, 16.0

    print(f"# (c) MultiWorkerMirroredStrategy vs DDP, {NUM_WORKERS} gloo processes x 1 thread each, "
          f"global batch {GLOBAL_BATCH}")
    print(f"# {machine_line()}")
    pairs: list[WorkerPair] = []
    try:
        pairs.append(WorkerPair("MultiWorkerMirrored", MultiWorker))
        pairs.append(WorkerPair("DDP", DDP))
        ours, ddp = pairs
        per_step = measure_interleaved(pairs, args.steps, args.rounds, args.warmup)
        ours_params, ddp_params = ours.params_all(), ddp.params_all()
        ours_f64, ddp_f64 = ours.reference_params_all(args.check_steps), ddp.reference_params_all(args.check_steps)
        allreduce = {}
        for width in ALLREDUCE_WIDTHS:
            nbytes = _allreduce_numel(width) * 4
            iters = max(3, round(args.ar_mib * 2**20 / nbytes))
            allreduce[width] = measure_allreduce(ours, ddp, width, iters, args.ar_rounds)
    finally:
        for p in pairs:
            try:
                p.stop()
            except Exception as error:  # noqa: BLE001 - stop() kills the processes anyway
                print(f"# stopping {p.name}: {error}", file=sys.stderr)

    # -- training ------------------------------------------------------------------------------
    names = [p.name for p in pairs]
    med = {name: statistics.median(per_step[name]) for name in names}
    ratio = median_ratio(per_step["DDP"], per_step["MultiWorkerMirrored"])
    for name in names:
        print(f"{name:>20}: {med[name] * 1e3:8.3f} ms/step  {1 / med[name]:6.2f} steps/s  "
              f"(rounds: {', '.join(f'{t * 1e3:.1f}' for t in per_step[name])})")
    print(f"throughput ratio ours / DDP: {ratio:.3f}  (goal >= 0.99; median of per-round ratios)")

    n_steps = args.warmup + args.rounds * args.steps
    workers_diff = max_abs_diff(ours_params[0], ours_params[1])
    ddp_workers_diff = max_abs_diff(ddp_params[0], ddp_params[1])
    diff, rel = max_abs_diff(ours_params[0], ddp_params[0]), relative_l2_diff(ours_params[0], ddp_params[0])
    f64_workers_diff = max_abs_diff(ours_f64[0], ours_f64[1])
    f64_diff = max_abs_diff(ours_f64[0], ddp_f64[0])
    print(f"params after the {n_steps} timed float32 steps, same init and batches:")
    print(f"  MWMS worker 0 vs worker 1: max abs diff {workers_diff:.3e}  (DDP rank 0 vs 1: {ddp_workers_diff:.3e})")
    print(f"  MWMS vs DDP: max abs diff {diff:.3e}, relative L2 {rel:.3e}  (0 expected: the same two "
          "half-batch gradients summed, scaled by powers of 2)")
    print(f"  float64, {args.check_steps} fresh steps: MWMS vs DDP {f64_diff:.3e}, MWMS worker 0 vs 1 "
          f"{f64_workers_diff:.3e} (tolerance {F64_TOLERANCE:g})")

    # -- all-reduce ----------------------------------------------------------------------------
    print("gradient all-reduce, 2 workers (GB/s = tensor bytes / time; median over rounds):")
    ar_rows = []
    for width, times in allreduce.items():
        nbytes = _allreduce_numel(width) * 4
        med_t = {k: statistics.median(v) for k, v in times.items()}
        gbps = {k: nbytes / t / 1e9 for k, t in med_t.items()}
        row = {
            "bytes": nbytes,
            "ours_s": med_t["ours"],
            "bare_s": med_t["bare"],
            "copies_s": med_t["bare+copies"],
            "ours_gbps": gbps["ours"],
            "bare_gbps": gbps["bare"],
            "copies_gbps": gbps["bare+copies"],
            "ratio_ours_over_bare": median_ratio(times["bare"], times["ours"]),
            "ratio_ours_over_copies": median_ratio(times["bare+copies"], times["ours"]),
        }
        ar_rows.append(row)
        print(f"  {nbytes / 2**20:6.2f} MiB: ours {med_t['ours'] * 1e3:7.2f} ms {gbps['ours']:6.3f} GB/s | "
              f"bare {med_t['bare'] * 1e3:7.2f} ms {gbps['bare']:6.3f} GB/s | "
              f"bare+copies {med_t['bare+copies'] * 1e3:7.2f} ms {gbps['bare+copies']:6.3f} GB/s | "
              f"ours/bare {row['ratio_ours_over_bare']:.3f}, ours/bare+copies {row['ratio_ours_over_copies']:.3f}")
    print(f"# load average at the end: {load_average()}")

    result = {
        "bench": "multi_worker",
        "global_batch": GLOBAL_BATCH,
        "workers": NUM_WORKERS,
        "ours_s_per_step": med["MultiWorkerMirrored"],
        "ddp_s_per_step": med["DDP"],
        "throughput_ratio_ours_over_ddp": ratio,
        "workers_param_max_abs_diff": workers_diff,
        "param_max_abs_diff_vs_ddp": diff,
        "param_rel_l2_diff_vs_ddp": rel,
        "f64_param_max_abs_diff_vs_ddp": f64_diff,
        "f64_workers_param_max_abs_diff": f64_workers_diff,
        "steps_trained": n_steps,
        "rounds": args.rounds,
        "steps": args.steps,
        "allreduce": ar_rows,
    }
    emit(result)
    if workers_diff != 0.0 or f64_workers_diff != 0.0 or not f64_diff <= F64_TOLERANCE:
        print("ERROR: MultiWorkerMirroredStrategy did not train like DDP (or its workers diverged)",
              file=sys.stderr)
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
