"""(b) ``td.MirroredStrategy`` over 2 CPU replicas vs one hand-written process vs 2-process DDP
(and ``td.CentralStorageStrategy`` on the same 2 CPU replicas).

All three train the tutorial CNN with Adam on the same synthetic global batches of 128, from
the same initial weights, each in its own process(es):

* ``MirroredStrategy``: ``td.MirroredStrategy(["cpu:0", "cpu:1"])`` in one process with the
  default torch threads (the strategy gives each replica thread its share); every global
  batch is split 64/64 by ``experimental_distribute_dataset``; ``optimizer.step()`` inside
  ``run`` sums the replicas' gradients into copy 0, steps, and broadcasts.
* ``hand-written``: the plain PyTorch loop on the whole batch of 128 in one process with the
  default torch threads (never imports torch_distribute).
* ``DDP``: ``DistributedDataParallel`` over 2 gloo processes on loopback, each with
  ``torch.set_num_threads(1)`` and its 64 rows of the global batch.

Reported: seconds per step and steps/s of each (median over interleaved rounds) and the
throughput ratios ours / hand-written and ours / DDP (> 1 means MirroredStrategy is faster).
Also ``MirroredStrategy`` with the loss-scaling check turned off
(``strategy.set_loss_scaling_check(False)``): the ratio checked / unchecked is the per-step
cost of inspecting every ``backward()``'s loss (``strategies/loss_scaling.py``), and the
check alone is timed on the tutorial step's loss (microseconds per ``backward()``).
The same for the non-finite gradient check (``td.config.set_nonfinite_check("off")``).
``--only-loss-check`` times just these three.
After timing, the parameters of MirroredStrategy are compared with the hand-written loop's
(same init, same batches, same number of steps): printed with DDP's for scale, since in
float32 Adam amplifies summation-order noise; then both train a fresh float64 copy for a
few steps, which must agree to 1e-9 (a benchmark that trains wrongly is worthless).

Run: ``python benchmarks/bench_mirrored.py [--rounds R --steps N --warmup W]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    Trainer,
    Variant,
    VariantProcess,
    ddp_trainer,
    emit,
    free_port,
    global_batches,
    handwritten_trainer,
    init_gloo,
    load_average,
    machine_line,
    make_model,
    max_abs_diff,
    measure_interleaved,
    median_ratio,
    relative_l2_diff,
    strategy_trainer,
)

GLOBAL_BATCH = 128
NUM_REPLICAS = 2
# In float32, Mirrored and the hand-written loop differ by summation order (two half-batch
# gradients summed vs one full-batch gradient); Adam divides by the gradient's RMS and so
# amplifies that noise (plain PyTorch, full batch vs two accumulated halves: ~1e-3 relative
# after 30 steps). The exact check is therefore in float64, where the same comparison gives
# ~1e-15. The float32 figures are printed for information only.
F64_TOLERANCE = 1e-9


class HandWritten(Variant):
    def build(self, dtype: torch.dtype) -> Trainer:
        return handwritten_trainer(dtype, GLOBAL_BATCH)


class Mirrored(Variant):
    def __init__(self, central_storage: bool = False, loss_check: bool = True, nonfinite_check: str = "warn"):
        self.central_storage = central_storage
        self.loss_check = loss_check
        self.nonfinite_check = nonfinite_check

    def setup(self) -> None:
        import torch_distribute as td

        devices = [f"cpu:{k}" for k in range(NUM_REPLICAS)]
        if self.central_storage:
            self.strategy = td.CentralStorageStrategy(devices)
        else:
            self.strategy = td.MirroredStrategy(devices)
        self.strategy.set_loss_scaling_check(self.loss_check)
        td.config.set_nonfinite_check(self.nonfinite_check)
        super().setup()

    def build(self, dtype: torch.dtype) -> Trainer:
        trainer = strategy_trainer(self.strategy, dtype, GLOBAL_BATCH)
        return MirroredTrainer(trainer.run_steps, trainer.model, self.strategy)


class MirroredTrainer(Trainer):
    def __init__(self, run_steps, model, strategy):
        super().__init__(run_steps, model)
        self.strategy = strategy

    def params(self) -> dict[str, torch.Tensor]:
        # Every replica's copy must be identical after a step; check, then return copy 0.
        for p in self.model.parameters():
            copies = self.strategy.experimental_local_results(p)
            assert len(copies) == NUM_REPLICAS, len(copies)
            for c in copies[1:]:
                assert torch.equal(c, copies[0]), "replica copies differ after a step"
        return super().params()


class DDP(Variant):
    def __init__(self, rank: int, world_size: int, port: int):
        self.rank, self.world_size, self.port = rank, world_size, port

    def setup(self) -> None:
        torch.set_num_threads(1)
        self.dist = init_gloo(self.port, self.rank, self.world_size)
        super().setup()

    def build(self, dtype: torch.dtype) -> Trainer:
        return ddp_trainer(self.rank, self.world_size, dtype, GLOBAL_BATCH, log_global_loss=False)

    def close(self) -> None:
        self.dist.destroy_process_group()


def loss_check_microseconds(repeats: int = 2000) -> float:
    """The check alone, on the tutorial step's loss (2 replicas, batch 64 each): microseconds
    per ``backward()``."""
    import time

    import torch.nn.functional as F

    import torch_distribute as td
    from torch_distribute.strategies import loss_scaling

    strategy = td.MirroredStrategy([f"cpu:{k}" for k in range(NUM_REPLICAS)])
    model = make_model()
    images, labels = next(iter(global_batches(GLOBAL_BATCH // NUM_REPLICAS)))
    per_example = F.cross_entropy(model(images), labels, reduction="none")
    loss = per_example.sum() / GLOBAL_BATCH  # what td.compute_average_loss builds

    def timed_checks(images: torch.Tensor, labels: torch.Tensor) -> float:
        started = time.perf_counter()
        for _ in range(repeats):
            loss_scaling.check_backward(strategy, NUM_REPLICAS, loss, None)
        return time.perf_counter() - started

    return loss_scaling.with_replica_inputs(timed_checks)(images, labels) / repeats * 1e6


def nonfinite_check_microseconds(repeats: int = 500) -> float:
    """The non-finite check alone on the tutorial model's gradients: microseconds per step."""
    import time

    from torch_distribute.strategies.nonfinite import gradients_finite

    grads = [torch.randn_like(p) for p in make_model().parameters()]
    started = time.perf_counter()
    for _ in range(repeats):
        bool(gradients_finite(grads))
    return (time.perf_counter() - started) / repeats * 1e6


def loss_check_only(args: argparse.Namespace) -> dict:
    print(f"# MirroredStrategy x{NUM_REPLICAS} CPU replicas, loss-scaling check on vs off, "
          f"global batch {GLOBAL_BATCH}")
    print(f"# {machine_line()}")
    variants = []
    try:
        variants.append(VariantProcess("Mirrored checked", Mirrored))
        variants.append(VariantProcess("Mirrored unchecked", Mirrored, [(False, False)]))
        variants.append(VariantProcess("Mirrored no NaN check", Mirrored, [(False, True, "off")]))
        per_step = measure_interleaved(variants, args.steps, args.rounds, args.warmup)
    finally:
        for v in variants:
            v.stop()
    return report_loss_check(per_step)


def report_loss_check(per_step: dict[str, list[float]]) -> dict:
    checked, unchecked = per_step["Mirrored checked"], per_step["Mirrored unchecked"]
    ratio = median_ratio(unchecked, checked)
    micros = loss_check_microseconds()
    print(f"{'checked':>18}: {statistics.median(checked) * 1e3:8.3f} ms/step")
    print(f"{'unchecked':>18}: {statistics.median(unchecked) * 1e3:8.3f} ms/step")
    print(f"throughput ratio loss check on / off: {ratio:.3f}  (1.000: no cost)")
    print(f"the loss check alone: {micros:.1f} us per backward()")
    nan_micros = nonfinite_check_microseconds()
    print(f"the non-finite check alone: {nan_micros:.1f} us per optimizer step")
    out = {"loss_check_throughput_ratio": ratio, "loss_check_us_per_backward": micros,
           "nonfinite_check_us_per_step": nan_micros,
           "checked_s_per_step": statistics.median(checked),
           "unchecked_s_per_step": statistics.median(unchecked)}
    if "Mirrored no NaN check" in per_step:
        no_nan = per_step["Mirrored no NaN check"]
        nan_ratio = median_ratio(no_nan, checked)
        print(f"{'no NaN check':>18}: {statistics.median(no_nan) * 1e3:8.3f} ms/step")
        print(f"throughput ratio NaN check on / off:  {nan_ratio:.3f}  (1.000: no cost)")
        out.update(nonfinite_check_throughput_ratio=nan_ratio, no_nonfinite_check_s_per_step=statistics.median(no_nan))
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=13)
    parser.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--check-steps", type=int, default=10, help="steps of the float64 check")
    parser.add_argument("--only-loss-check", action="store_true",
                        help="time MirroredStrategy with the loss-scaling check on and off only")
    args = parser.parse_args(argv)
    if args.only_loss_check:
        result = {"bench": "mirrored_loss_check", **loss_check_only(args)}
        emit(result)
        return result

    print(f"# (b) MirroredStrategy x{NUM_REPLICAS} CPU replicas vs hand-written vs DDP gloo x{NUM_REPLICAS}, "
          f"global batch {GLOBAL_BATCH}")
    print(f"# {machine_line()}")
    port = free_port()
    variants = []
    try:
        variants.append(VariantProcess("hand-written", HandWritten))
        variants.append(VariantProcess("MirroredStrategy", Mirrored))
        variants.append(VariantProcess(
            "DDP", DDP, [(rank, NUM_REPLICAS, port) for rank in range(NUM_REPLICAS)]
        ))
        variants.append(VariantProcess("CentralStorage", Mirrored, [(True,)]))
        variants.append(VariantProcess("Mirrored unchecked", Mirrored, [(False, False)]))
        hand, mirrored, ddp, central, _ = variants
        per_step = measure_interleaved(variants, args.steps, args.rounds, args.warmup)
        hand_params, ours_params, ddp_params = hand.params(), mirrored.params(), ddp.params()
        central_params = central.params()
        hand_f64 = hand.reference_params(args.check_steps)
        ours_f64 = mirrored.reference_params(args.check_steps)
        central_f64 = central.reference_params(args.check_steps)
    finally:
        for v in variants:
            v.stop()

    med = {name: statistics.median(times) for name, times in per_step.items()}
    vs_hand = median_ratio(per_step["hand-written"], per_step["MirroredStrategy"])
    vs_ddp = median_ratio(per_step["DDP"], per_step["MirroredStrategy"])
    central_vs_hand = median_ratio(per_step["hand-written"], per_step["CentralStorage"])
    central_vs_mirrored = median_ratio(per_step["MirroredStrategy"], per_step["CentralStorage"])
    for name, times in per_step.items():
        print(f"{name:>18}: {med[name] * 1e3:8.3f} ms/step  {1 / med[name]:6.2f} steps/s  "
              f"(rounds: {', '.join(f'{t * 1e3:.1f}' for t in times)})")
    print(f"throughput ratio ours / hand-written: {vs_hand:.3f}  (> 1: MirroredStrategy is faster)")
    print(f"throughput ratio ours / DDP:          {vs_ddp:.3f}")
    print(f"CentralStorage / hand-written:        {central_vs_hand:.3f}")
    print(f"CentralStorage / MirroredStrategy:    {central_vs_mirrored:.3f}")
    loss_check = report_loss_check({"Mirrored checked": per_step["MirroredStrategy"],
                                    "Mirrored unchecked": per_step["Mirrored unchecked"]})

    n_steps = args.warmup + args.rounds * args.steps
    diff, rel = max_abs_diff(ours_params, hand_params), relative_l2_diff(ours_params, hand_params)
    ddp_diff, ddp_rel = max_abs_diff(ddp_params, hand_params), relative_l2_diff(ddp_params, hand_params)
    f64_diff = max_abs_diff(ours_f64, hand_f64)
    central_f64_diff = max_abs_diff(central_f64, hand_f64)
    print(f"params after the {n_steps} timed float32 steps, same init and batches "
          "(max abs diff / relative L2 diff):")
    print(f"  Mirrored vs hand-written: {diff:.3e} / {rel:.3e}")
    print(f"  DDP      vs hand-written: {ddp_diff:.3e} / {ddp_rel:.3e}  (float32 summation-order noise, "
          "amplified by Adam)")
    print(f"  Mirrored vs DDP:          {max_abs_diff(ours_params, ddp_params):.3e} / "
          f"{relative_l2_diff(ours_params, ddp_params):.3e}")
    print(f"  float64, {args.check_steps} fresh steps, Mirrored vs hand-written: {f64_diff:.3e} "
          f"(tolerance {F64_TOLERANCE:g})")
    print(f"  CentralStorage vs Mirrored (float32): {max_abs_diff(central_params, ours_params):.3e}; "
          f"float64 vs hand-written: {central_f64_diff:.3e}")
    print(f"# load average at the end: {load_average()}")
    result = {
        "bench": "mirrored",
        "global_batch": GLOBAL_BATCH,
        "replicas": NUM_REPLICAS,
        "hand_s_per_step": med["hand-written"],
        "ours_s_per_step": med["MirroredStrategy"],
        "ddp_s_per_step": med["DDP"],
        "throughput_ratio_ours_over_hand": vs_hand,
        "throughput_ratio_ours_over_ddp": vs_ddp,
        "param_max_abs_diff": diff,
        "param_rel_l2_diff": rel,
        "ddp_param_max_abs_diff": ddp_diff,
        "ddp_param_rel_l2_diff": ddp_rel,
        "f64_param_max_abs_diff": f64_diff,
        "central_s_per_step": med["CentralStorage"],
        "central_throughput_ratio_over_hand": central_vs_hand,
        "central_throughput_ratio_over_mirrored": central_vs_mirrored,
        "central_f64_param_max_abs_diff": central_f64_diff,
        **loss_check,
        "steps_trained": n_steps,
        "rounds": args.rounds,
        "steps": args.steps,
    }
    emit(result)
    if not (f64_diff <= F64_TOLERANCE and central_f64_diff <= F64_TOLERANCE):
        print("ERROR: a strategy did not train like the hand-written loop", file=sys.stderr)
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
