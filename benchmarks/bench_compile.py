"""(d) Compiled steps: ``@td.function`` vs the hand-written ``torch.compile`` loop, on CPU.

Every variant trains the tutorial CNN with Adam on the same synthetic global batches of 64
(as ``bench_one_device.py``), from the same initial weights, each in its own process with the
default torch threads:

* ``hand-eager``: the plain PyTorch loop (``common.handwritten_trainer``); never imports
  torch_distribute.
* ``hand-compiled``: the ``torch.compile`` loop a PyTorch user writes: ``cmodel =
  torch.compile(model)``; the loss, ``loss.backward()``, ``optimizer.step()`` and
  ``optimizer.zero_grad()`` eager.
* ``hand-compiled-step``: the whole step function (forward, loss, backward, step, zero_grad)
  under ``torch.compile``; dynamo breaks the graph at ``loss.backward()`` and compiles what
  follows (Adam's step included) as further graphs.
* ``one-eager`` / ``one-function``: ``td.OneDeviceStrategy("cpu")``, model and optimizer made
  in ``strategy.scope()``, batches through ``strategy.experimental_distribute_dataset``, the
  step through ``strategy.run`` and a SUM ``strategy.reduce`` of the loss (as
  ``common.strategy_trainer``); in ``one-function`` the distributed step is decorated with
  ``@td.function`` (the port of ``@tf.function``: what ``run`` runs is compiled).
* ``mirrored-eager`` / ``mirrored-function``: the same under
  ``td.MirroredStrategy(["cpu:0", "cpu:1"])``, same global batch (32 rows per replica).
* ``mirrored-compiled``: the hand-written way under Mirrored (README, "Compiled steps"):
  ``torch.compile(model)`` inside the scope, the step eager, no ``td.function``. It is the
  compiled baseline of the same replica threads: ``mirrored-function`` / ``mirrored-compiled``
  is what ``td.function`` itself costs there; both against ``hand-compiled`` add what running
  inductor's kernels in two replica threads of one process costs.
* ``ddp-compiled``: the fair baseline of ``mirrored-function``: ``DistributedDataParallel``
  with 2 processes (Gloo over loopback, one torch thread each, as each replica thread),
  ``DistributedDataParallel(torch.compile(model))`` (the other order compiles nothing on torch
  2.13: see ``common.ddp_trainer``), each process on its 32 rows.

Compilation happens in the warm-up steps, which run one at a time in each process before any
timing (the other processes idle meanwhile) and are excluded from the timed rounds. Reported
per variant: ms per step (median over interleaved rounds), the speed ratios
``hand-eager time / variant time`` and ``best hand-compiled time / variant time`` (median of
the per-round ratios; the baseline is whichever of ``hand-compiled`` and
``hand-compiled-step`` has the lower median), the first call's seconds (compilation
included), the compile seconds (warm-up time minus warm-up steps x the steady ms/step, so
recompiles in later warm-up steps count too), the graphs dynamo compiled and, for
``td.function``, ``experimental_get_tracing_count()``. The inductor caches are disabled in
every process (``--cache`` keeps them), so each compiling variant pays a cold compile.

glibc's malloc is pinned in every process (``MALLOC_MMAP_THRESHOLD_`` 32 MiB,
``MALLOC_TRIM_THRESHOLD_`` 256 MiB, unless already set; ``--malloc-defaults`` leaves glibc
alone). With glibc's default, the mmap threshold adapts to each process's allocation history,
so one process may re-fault the step's activation buffers from the kernel every step and
another not: on the 2-core test machine, identical eager loops ran 10 to 15 ms per step
depending on the process (900 to 3,600 minor page faults per step), more than the differences
measured here. Pinned, they fault ~0 times per step and agree.

Also printed: each variant's best round and the speed ratio of the best rounds, which a
machine shared with other work distorts less: a process with two OpenMP threads (every
variant but the Mirrored ones, whose replica threads run one intra-op thread each) slows
down many times over whenever one of the two cores is taken.

Goal: ``one-function`` at least as fast as the hand-written compiled loop within 2%, i.e.
``hand-compiled time / one-function time >= 0.98``. Nothing is asserted: on 2 CPU cores the
figures are noisy, and this script reports ratios.

Equivalence (printed, not asserted): after the timed run every variant has trained the same
number of steps on the same batches from the same weights; its parameters are compared with
``hand-eager``'s (max abs diff and relative L2 diff; Adam amplifies float32 summation-order
noise over hundreds of steps, see ``bench_mirrored.py``). Then every process trains a fresh
float32 copy for ``--check-steps`` steps (compiled again, untimed; 0 skips it), which should
match ``hand-eager``'s to ~1e-4. Where dynamo traces Adam's update (``hand-compiled-step``,
and ``one-function``: one replica does not route ``optimizer.step()``), the compiled update
computes the bias corrections in float32 (``1 - 0.999`` rounded: ~6e-6 relative on the first
updates, also in a float64 model), and Adam amplifies that on near-zero gradients: about 20
of the ~120k parameters then differ by >1e-4 (up to 3e-3) after 10 steps, the relative L2
difference 4.5e-4.

Run: ``python benchmarks/bench_compile.py [--quick] [--rounds R --steps N --warmup W]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    Cycle,
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
    make_optimizer,
    max_abs_diff,
    measure_interleaved,
    median_ratio,
    relative_l2_diff,
    strategy_trainer,
    timed,
)

GLOBAL_BATCH = 64
NUM_REPLICAS = 2
VARIANTS = (
    "hand-eager",
    "hand-compiled",
    "hand-compiled-step",
    "one-eager",
    "one-function",
    "mirrored-eager",
    "mirrored-function",
    "mirrored-compiled",
    "ddp-compiled",
)
HAND_COMPILED = ("hand-compiled", "hand-compiled-step")
# Read by glibc when each worker process starts (see the module docstring).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(256 * 2**20)}
GOAL = 0.98  # hand-compiled time / td.function time
MIRRORED_GOALS = {"mirrored-eager": 1.0, "ddp-compiled": 0.95}  # reference time / mirrored-function time
# Statistics travel back with the parameters (``VariantProcess.params``) under keys with this
# prefix, so that the graphs compiled *after* the timed rounds (recompiles) can be reported.
STATS_PREFIX = "__stats__."


# -- trainers ----------------------------------------------------------------------------------
def hand_compiled_trainer(dtype: torch.dtype, global_batch: int, whole_step: bool) -> Trainer:
    """The hand-written step with ``torch.compile``: on the model, or on the whole step."""
    import torch.nn.functional as F

    model = make_model(dtype=dtype)
    optimizer = make_optimizer(model)
    batches = Cycle(global_batches(global_batch, dtype=dtype))
    total = torch.zeros((), dtype=dtype)
    forward = model if whole_step else torch.compile(model)

    def step(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = forward(images)
        loss = F.cross_entropy(logits, labels, reduction="none").sum() / global_batch
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    if whole_step:
        step = torch.compile(step)

    def run_steps(n: int) -> None:
        nonlocal total
        for _ in range(n):
            total += step(*next(batches))

    return Trainer(run_steps, model)


def compiled_strategy_trainer(strategy, dtype: torch.dtype, global_batch: int, how: str) -> Trainer:
    """``common.strategy_trainer``'s step, compiled: ``how="function"``: the distributed step
    decorated with ``td.function``; ``how="model"``: ``torch.compile(model)`` in the scope."""
    import torch.nn.functional as F

    import torch_distribute as td

    with strategy.scope():
        model = make_model(dtype=dtype)
        optimizer = make_optimizer(model)
        forward = torch.compile(model) if how == "model" else model
    batches = Cycle(strategy.experimental_distribute_dataset(global_batches(global_batch, dtype=dtype)))
    total = torch.zeros((), dtype=dtype)

    def train_step(batch):
        images, labels = batch
        logits = forward(images)
        loss = td.compute_average_loss(
            F.cross_entropy(logits, labels, reduction="none"), global_batch_size=global_batch
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def distributed_train_step(batch):
        per_replica = strategy.run(train_step, args=(batch,))
        return strategy.reduce("sum", per_replica, axis=None)

    if how == "function":
        distributed_train_step = td.function(distributed_train_step)

    def run_steps(n: int) -> None:
        nonlocal total
        for _ in range(n):
            total += distributed_train_step(next(batches))

    trainer = Trainer(run_steps, model)
    if how == "function":
        trainer.function = distributed_train_step
    return trainer


# -- the variant in its worker process ------------------------------------------------------------
def dynamo_stats() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


class CompileVariant(Variant):
    """One of ``VARIANTS``; runs its warm-up steps (compilation included) in ``setup``."""

    def __init__(self, kind: str, warmup: int, cache: bool, rank: int = 0, port: int = 0):
        self.kind, self.warmup, self.cache = kind, warmup, cache
        self.rank, self.port = rank, port
        self.strategy = None

    def setup(self) -> None:
        if not self.cache:
            torch.compiler.config.force_disable_caches = True
            warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
        if self.kind.startswith(("one-", "mirrored-")):
            import torch_distribute as td

            if self.kind.startswith("one-"):
                self.strategy = td.OneDeviceStrategy("cpu")
            else:
                self.strategy = td.MirroredStrategy([f"cpu:{k}" for k in range(NUM_REPLICAS)])
        elif self.kind.startswith("ddp-"):
            init_gloo(self.port, self.rank, NUM_REPLICAS)
        super().setup()
        # One step at a time: the first call pays the compilation.
        self.warmup_s = [timed(self.trainer.run_steps, 1) for _ in range(self.warmup)]
        self.after_warmup = self.stats(self.trainer)

    def build(self, dtype: torch.dtype) -> Trainer:
        kind = self.kind
        if kind == "hand-eager":
            return handwritten_trainer(dtype, GLOBAL_BATCH)
        if kind in HAND_COMPILED:
            return hand_compiled_trainer(dtype, GLOBAL_BATCH, whole_step=kind == "hand-compiled-step")
        if kind.endswith("-eager"):
            return strategy_trainer(self.strategy, dtype, GLOBAL_BATCH)
        if kind.endswith("-function"):
            return compiled_strategy_trainer(self.strategy, dtype, GLOBAL_BATCH, "function")
        if kind == "mirrored-compiled":
            return compiled_strategy_trainer(self.strategy, dtype, GLOBAL_BATCH, "model")
        if kind == "ddp-compiled":
            return ddp_trainer(self.rank, NUM_REPLICAS, dtype, GLOBAL_BATCH, log_global_loss=True, compile=True)
        raise ValueError(kind)

    def stats(self, trainer: Trainer) -> dict[str, int]:
        out = dynamo_stats()
        function = getattr(trainer, "function", None)
        if function is not None:
            out["tracing_count"] = function.experimental_get_tracing_count()
        return out

    def replica_copies_max_diff(self, model: torch.nn.Module) -> float:
        """Largest difference between a replica's copy of a parameter and copy 0 (0 expected)."""
        if self.strategy is None:
            return 0.0
        worst = 0.0
        for p in model.parameters():
            copies = self.strategy.experimental_local_results(p)
            for c in copies[1:]:
                worst = max(worst, float((c.detach().cpu() - copies[0].detach().cpu()).abs().max()))
        return worst

    def params(self) -> dict[str, torch.Tensor]:
        out = self.trainer.params()
        stats = {**self.stats(self.trainer), "replica_copies_max_diff": self.replica_copies_max_diff(self.trainer.model)}
        out.update({STATS_PREFIX + k: torch.tensor(v) for k, v in stats.items()})
        return out

    def reference_params(self, steps: int) -> dict[str, torch.Tensor]:
        # The fresh check is float32 here (common's default is float64): compiled float32 is
        # what is timed. The fresh model makes dynamo compile again (new objects fail the guards).
        trainer = self.build(torch.float32)
        trainer.run_steps(steps)
        return trainer.params()

    def info(self) -> dict:
        return {**super().info(), "warmup_s": self.warmup_s, "after_warmup": self.after_warmup}


def split_stats(params: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    stats = {k[len(STATS_PREFIX):]: float(v) for k, v in params.items() if k.startswith(STATS_PREFIX)}
    return {k: v for k, v in params.items() if not k.startswith(STATS_PREFIX)}, stats


# -- main ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps, compilation included")
    parser.add_argument("--check-steps", type=int, default=10, help="steps of the fresh float32 check (0: none)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of: " + ", ".join(VARIANTS))
    parser.add_argument("--cache", action="store_true", help="keep the inductor caches (warm compiles)")
    parser.add_argument("--malloc-defaults", action="store_true",
                        help="do not pin glibc's malloc thresholds in the worker processes")
    parser.add_argument("--quick", action="store_true", help="few rounds: a smoke test, not figures")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.check_steps = 3, 5, 3, 3
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown or "hand-eager" not in names or not set(HAND_COMPILED) & set(names):
        parser.error(f"--variants: unknown {unknown}; hand-eager and a hand-compiled variant are needed")
    if args.warmup < 2:
        parser.error("--warmup: at least 2 (the first step compiles)")

    print(f"# (d) td.function vs hand-written torch.compile, global batch {GLOBAL_BATCH}, "
          f"{'warm' if args.cache else 'cold (caches disabled)'} compiles")
    print(f"# {machine_line()}")
    if not args.malloc_defaults:
        for key, value in MALLOC_ENV.items():
            os.environ.setdefault(key, value)  # the spawned workers inherit it
    print("# malloc: " + (", ".join(f"{k}={os.environ.get(k, 'default')}" for k in MALLOC_ENV)))
    procs: list[VariantProcess] = []
    try:
        for name in names:
            if name.startswith("ddp-"):  # one process per replica, each with one torch thread
                port = free_port()
                procs.append(VariantProcess(name, CompileVariant, [
                    (name, args.warmup, args.cache, rank, port) for rank in range(NUM_REPLICAS)], num_threads=1))
            else:
                procs.append(VariantProcess(name, CompileVariant, [(name, args.warmup, args.cache)]))
            info = procs[-1].info
            print(f"# warm-up {name}: {', '.join(f'{t:.3f}' for t in info['warmup_s'])} s "
                  f"(torch threads {info['torch_threads']})", flush=True)
        # The warm-up ran in setup; warmup=0 here.
        per_step = measure_interleaved(procs, args.steps, args.rounds, 0)
        final = {p.name: split_stats(p.params()) for p in procs}
        fresh = {p.name: p.reference_params(args.check_steps) for p in procs} if args.check_steps else {}
    finally:
        for p in procs:
            p.stop()

    info = {p.name: p.info for p in procs}
    med = {name: statistics.median(per_step[name]) for name in names}
    baseline = min((n for n in HAND_COMPILED if n in names), key=lambda n: med[n])
    vs_eager = {n: median_ratio(per_step["hand-eager"], per_step[n]) for n in names}
    vs_compiled = {n: median_ratio(per_step[baseline], per_step[n]) for n in names}
    hand_params = final["hand-eager"][0]
    n_steps = args.warmup + args.rounds * args.steps

    rows = {}
    for n in names:
        warm = info[n]["warmup_s"]
        params, stats = final[n]
        rows[n] = {
            "s_per_step": med[n],
            "best_s_per_step": min(per_step[n]),
            "best_speed_vs_hand_compiled": min(per_step[baseline]) / min(per_step[n]),
            "speed_vs_hand_eager": vs_eager[n],
            "speed_vs_hand_compiled": vs_compiled[n],
            "first_call_s": warm[0],
            "compile_s": max(0.0, sum(warm) - len(warm) * med[n]),
            "graphs_after_warmup": info[n]["after_warmup"]["graphs"],
            "graphs": int(stats["graphs"]),
            "graph_breaks": int(stats["graph_breaks"]),
            "tracing_count": int(stats["tracing_count"]) if "tracing_count" in stats else None,
            "replica_copies_max_diff": stats["replica_copies_max_diff"],
            "param_max_abs_diff": max_abs_diff(params, hand_params),
            "param_rel_l2_diff": relative_l2_diff(params, hand_params),
            "fresh_param_max_abs_diff": max_abs_diff(fresh[n], fresh["hand-eager"]) if fresh else None,
            "fresh_param_rel_l2_diff": relative_l2_diff(fresh[n], fresh["hand-eager"]) if fresh else None,
        }

    for n in names:
        print(f"{n:>19}: {med[n] * 1e3:8.3f} ms/step  (rounds: {', '.join(f'{t * 1e3:.2f}' for t in per_step[n])})")
    print()
    print(f"| variant | ms/step (median) | speed vs hand-eager | speed vs {baseline} | ms/step (best round) "
          f"| speed vs {baseline} (best rounds) | first call s | compile s | graphs (td tracing count) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for n in names:
        r = rows[n]
        graphs = str(r["graphs"]) if r["graphs"] else "-"
        if r["tracing_count"] is not None:
            graphs += f" ({r['tracing_count']})"
        print(f"| {n} | {r['s_per_step'] * 1e3:.2f} | {r['speed_vs_hand_eager']:.3f} | "
              f"{r['speed_vs_hand_compiled']:.3f} | {r['best_s_per_step'] * 1e3:.2f} | "
              f"{r['best_speed_vs_hand_compiled']:.3f} | {r['first_call_s']:.2f} | {r['compile_s']:.2f} | {graphs} |")
    print()
    print("speed = reference time / variant time, median of per-round ratios (> 1: the variant is "
          f"faster); baseline for the compiled ratios: {baseline} (the faster hand-written compiled loop)")
    for n in ("one-function", "mirrored-function"):
        if n in rows:
            print(f"{n} vs {baseline}: {rows[n]['speed_vs_hand_compiled']:.3f}"
                  + (f"  (goal >= {GOAL})" if n == "one-function" else ""))
    # td.function against the same strategy's other ways: what td.function itself adds.
    pairs = {"one-function": ("one-eager",),
             "mirrored-function": ("mirrored-eager", "mirrored-compiled", "ddp-compiled")}
    same_strategy = {}
    for n, refs in pairs.items():
        for ref in refs:
            if n in names and ref in names:
                same_strategy[f"{n}_vs_{ref}"] = median_ratio(per_step[ref], per_step[n])
                goal = MIRRORED_GOALS.get(ref) if n == "mirrored-function" else None
                print(f"{n} vs {ref}: {same_strategy[f'{n}_vs_{ref}']:.3f}"
                      + (f"  (goal >= {goal})" if goal else ""))
    for n in names:
        r = rows[n]
        if r["graphs"] != r["graphs_after_warmup"]:
            print(f"NOTE: {n} compiled {r['graphs'] - r['graphs_after_warmup']} graph(s) after the warm-up "
                  "(recompiles inside the timed rounds)")
    print(f"params vs hand-eager (max abs / relative L2) after the {n_steps} timed float32 steps"
          + (f", and after {args.check_steps} fresh float32 steps (~1e-4 expected):" if fresh else ":"))
    for n in names:
        r = rows[n]
        line = f"  {n:>19}: {r['param_max_abs_diff']:.3e} / {r['param_rel_l2_diff']:.3e}"
        if fresh:
            line += f";  fresh: {r['fresh_param_max_abs_diff']:.3e} / {r['fresh_param_rel_l2_diff']:.3e}"
        if n.startswith("mirrored"):
            line += f";  replica copies differ by {r['replica_copies_max_diff']:.1e}"
        print(line)
    print(f"# load average at the end: {load_average()}")
    result = {
        "bench": "compile",
        "global_batch": GLOBAL_BATCH,
        "replicas": NUM_REPLICAS,
        "baseline": baseline,
        "goal_speed_vs_hand_compiled": GOAL,
        "variants": rows,
        "same_strategy_speed": same_strategy,
        "steps_trained": n_steps,
        "check_steps": args.check_steps,
        "cold_compile": not args.cache,
        "malloc": {k: os.environ.get(k) for k in MALLOC_ENV},
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
    }
    emit(result)
    return result


if __name__ == "__main__":
    main()
