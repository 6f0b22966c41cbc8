"""(n) ``td.function`` on GAN steps, on the CPU: backward work, speed and warm-up against eager
and the hand-compiled networks (a diagnostic of issue 45, not part of ``make bench``).

Two steps that call ``backward`` several times, each on a part of the graph:

* ``cyclegan``: ``examples/cyclegan``'s train step (the TensorFlow tutorial's: four networks,
  one forward pass, then ``backward(inputs=<that network's parameters>)`` for each of the
  four losses, then the four Adam steps), run through ``bench_cyclegan_gpu.py``'s own
  variants on the CPU at a small size.
* ``dcgan``: the PyTorch DCGAN tutorial's step: the discriminator on a real batch and on
  ``fake.detach()``, its backward and Adam step, then the generator's loss through the
  updated discriminator, its backward and step (BatchNorm in both networks).

Variants (the names of ``bench_cyclegan_gpu.py``):

* ``hand-eager``: plain PyTorch, no strategy.
* ``hand-compiled``: the same with ``torch.compile`` on each network.
* ``one-eager``: ``td.OneDeviceStrategy("cpu")``, the distributed step (``strategy.run`` of
  the replica step, a SUM ``strategy.reduce`` of its loss) eager: what the strategy itself costs.
* ``one-function-whole``: the same under ``td.function(..., split_networks=False)``: the replica step's whole forward as one graph,
  what ``td.function`` compiled before it split at networks. The DCGAN step fails there
  ("backward through the graph a second time": the discriminator's backward frees the one
  graph's saved tensors, which the generator's backward needs).
* ``one-function``: ``td.function`` as it is now: the scope made several networks, so each
  network's forward is a graph of its own, and the code between them (losses, optimizer
  steps) the graphs around them.

Each (step, variant) runs in its own process, with one torch thread (``--threads``) and an
empty inductor cache of its own (a temporary ``TORCHINDUCTOR_CACHE_DIR``), so the first call
is a cold compile, as on a user's first run. Reported: the first call's seconds (warm-up),
the ms per step over ``--steps`` steps after ``--warmup`` calls, the convolution backward
kernels per step (``torch.profiler`` over ``--profile-steps`` steps), the graphs compiled
(``experimental_get_tracing_count()`` for ``td.function``), the last loss (equal seeds: the
variants should agree to float32 noise), and the ratios against ``hand-eager`` and
``hand-compiled`` (their ms per step or warm-up over this variant's: above 1 is faster).

Run: ``python benchmarks/profile_gan_steps_cpu.py [--steps-to-run cyclegan,dcgan --steps 20]``.
The last line printed is ``GANSTEPS {json}`` with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
from torch import nn  # noqa: E402

RESULT = "GANSTEPS "
CHILD_RESULT = "GANSTEP "
MODELS = ("cyclegan", "dcgan")
VARIANTS = ("hand-eager", "hand-compiled", "one-eager", "one-function-whole", "one-function")
CONV_BACKWARD = "aten::convolution_backward"


# -- the DCGAN step ------------------------------------------------------------------------
def dcgan_networks(latent: int, filters: int) -> tuple[nn.Module, nn.Module]:
    """The DCGAN tutorial's networks at 16x16 (two up- and two down-samplings)."""
    generator = nn.Sequential(
        nn.ConvTranspose2d(latent, filters * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(filters * 2), nn.ReLU(True),
        nn.ConvTranspose2d(filters * 2, filters, 4, 2, 1, bias=False), nn.BatchNorm2d(filters), nn.ReLU(True),
        nn.ConvTranspose2d(filters, 3, 4, 2, 1, bias=False), nn.Tanh())
    discriminator = nn.Sequential(
        nn.Conv2d(3, filters, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(filters, filters * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(filters * 2),
        nn.LeakyReLU(0.2, inplace=True), nn.Conv2d(filters * 2, 1, 4, 1, 0, bias=False), nn.Flatten())
    return generator, discriminator


def dcgan_step(generator: nn.Module, discriminator: nn.Module, optimizers: tuple[Any, Any],
               average: Any) -> Any:
    """The tutorial's step; ``average(per_sample)`` makes a loss of per-sample values."""
    optimizer_g, optimizer_d = optimizers
    bce = nn.functional.binary_cross_entropy_with_logits

    def step(real: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        fake = generator(noise)
        d_real, d_fake = discriminator(real), discriminator(fake.detach())
        loss_d = average(bce(d_real, torch.ones_like(d_real), reduction="none").squeeze(1)
                         + bce(d_fake, torch.zeros_like(d_fake), reduction="none").squeeze(1))
        loss_d.backward()
        optimizer_d.step()
        optimizer_d.zero_grad()
        d_fake = discriminator(fake)
        loss_g = average(bce(d_fake, torch.ones_like(d_fake), reduction="none").squeeze(1))
        loss_g.backward()
        optimizer_g.step()
        optimizer_g.zero_grad()
        return loss_g.detach()

    return step


def _dcgan_runner(variant: str, args: argparse.Namespace) -> tuple[Any, Any, Any]:
    generator_rng = torch.Generator().manual_seed(1)
    pool = [(torch.rand(args.batch, 3, 16, 16, generator=generator_rng) * 2 - 1,
             torch.randn(args.batch, args.latent, 1, 1, generator=generator_rng)) for _ in range(4)]
    batches = [pool[i % len(pool)] for i in range(args.warmup + args.steps)]

    def build() -> tuple[nn.Module, nn.Module, tuple[Any, Any]]:
        torch.manual_seed(0)
        g, d = dcgan_networks(args.latent, args.filters)
        adam = {"lr": 2e-4, "betas": (0.5, 0.999), "fused": True if args.fused_adam else None}
        return g, d, (torch.optim.Adam(g.parameters(), **adam), torch.optim.Adam(d.parameters(), **adam))

    if variant.startswith("hand"):
        g, d, optimizers = build()
        if variant == "hand-compiled":
            g, d = torch.compile(g, dynamic=False), torch.compile(d, dynamic=False)
        step = dcgan_step(g, d, optimizers, lambda per_sample: per_sample.mean())
        return (lambda batch: step(*batch)), batches, None
    import torch_distribute as td

    strategy = td.OneDeviceStrategy("cpu")
    with strategy.scope():
        g, d, optimizers = build()
    replica_step = dcgan_step(g, d, optimizers,
                              lambda per_sample: td.compute_average_loss(per_sample, global_batch_size=args.batch))

    def distributed_step(real: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return strategy.reduce("sum", strategy.run(replica_step, args=(real, noise)), axis=None)

    function = None
    if "-function" in variant:
        split = {"split_networks": False} if variant.endswith("-whole") else {}
        function = distributed_step = td.function(distributed_step, dynamic=False, **split)
    return (lambda batch: distributed_step(*batch)), strategy.experimental_distribute_dataset(batches), function


def _cyclegan_runner(variant: str, args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """``bench_cyclegan_gpu.py``'s own variant on the CPU (the step the GPU report times)."""
    import bench_cyclegan_gpu as cyclegan

    bench_args = cyclegan.build_parser().parse_args([
        "--device", "cpu", "--image-size", str(args.image_size), "--generator-filters", str(args.filters),
        "--residual-blocks", str(args.residual_blocks), "--discriminator-filters", str(args.filters),
        "--discriminator-layers", "3", "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--batch-size", "1", *(["--fused-adam"] if args.fused_adam else [])])
    build = cyclegan._hand_runner if variant.startswith("hand") else cyclegan._strategy_runner
    step, batches, function, _ = build(variant, bench_args, torch.device("cpu"), None)
    return step, batches, function


def measure(variant: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """The first call, ``--warmup`` calls in all, ``--steps`` timed, ``--profile-steps`` profiled."""
    from torch.profiler import profile

    runner = _cyclegan_runner if model == "cyclegan" else _dcgan_runner
    step, batches, function = runner(variant, args)
    iterator = iter(batches)
    started = time.perf_counter()
    try:
        loss = step(next(iterator))
    except Exception as error:  # noqa: BLE001 - reported: the variant cannot run this step
        return {"status": "failed", "reason": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
    first_call_s = time.perf_counter() - started
    for _ in range(args.warmup - 1):
        step(next(iterator))
    started = time.perf_counter()
    for batch in iterator:
        loss = step(batch)
    ms = (time.perf_counter() - started) / args.steps * 1e3
    iterator = iter(batches)
    with profile() as prof:
        for _ in range(args.profile_steps):
            step(next(iterator))
    conv_backward = sum(event.name == CONV_BACKWARD for event in prof.events()) / args.profile_steps
    return {"status": "ok", "first_call_s": first_call_s, "ms_per_step": ms, "last_loss": float(loss),
            "conv_backward_per_step": conv_backward,
            "graphs": function.experimental_get_tracing_count() if function is not None else None}


# -- the parent ------------------------------------------------------------------------------
def child(model: str, variant: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    print(CHILD_RESULT + json.dumps(measure(variant, model, args)), flush=True)


def spawn(model: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="td-gan-steps-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, PYTHONUNBUFFERED="1")
        command = [sys.executable, HERE, "--child", model, variant, *_shared_flags(args)]
        try:
            out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                                 timeout=args.child_timeout)
        except subprocess.TimeoutExpired:
            return {"status": "failed", "reason": f"no result in {args.child_timeout} s"}
    for line in out.stdout.splitlines():
        if line.startswith(CHILD_RESULT):
            return json.loads(line[len(CHILD_RESULT):])
    return {"status": "failed", "reason": f"exit status {out.returncode}: {out.stderr[-400:]}"}


def _shared_flags(args: argparse.Namespace) -> list[str]:
    return ["--steps", str(args.steps), "--warmup", str(args.warmup), "--profile-steps", str(args.profile_steps),
            "--threads", str(args.threads), "--image-size", str(args.image_size), "--filters", str(args.filters),
            "--residual-blocks", str(args.residual_blocks), "--batch", str(args.batch), "--latent", str(args.latent),
            *(["--fused-adam"] if args.fused_adam else [])]


def _ratio(base: dict[str, Any] | None, row: dict[str, Any], key: str) -> float | None:
    if not base or base.get("status") != "ok" or row.get("status") != "ok" or not row[key]:
        return None
    return base[key] / row[key]


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(results: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace) -> None:
    print(f"# torch {torch.__version__}, CPU, {args.threads} torch thread(s) per process, a cold inductor cache "
          f"per process; {args.steps} timed steps after {args.warmup} warm-up calls; speed ratio: the baseline's "
          "ms/step over this variant's (above 1: faster); warm-up ratio: this variant's first call over the "
          "baseline's (below 1: shorter)")
    print(f"{'step':<9} {'variant':<19} {'conv bw/step':>12} {'ms/step':>8} {'vs eager':>8} {'vs comp.':>8} "
          f"{'1st call s':>10} {'warm-up/comp.':>13} {'graphs':>6} {'loss':>9}")
    for model, rows in results.items():
        for variant, row in rows.items():
            if row.get("status") != "ok":
                print(f"{model:<9} {variant:<19} {row.get('status')}: {row.get('reason')}")
                continue
            compiled = rows.get("hand-compiled")
            warm_ratio = (row["first_call_s"] / compiled["first_call_s"]
                          if compiled and compiled.get("status") == "ok" else None)
            print(f"{model:<9} {variant:<19} {row['conv_backward_per_step']:12g} {row['ms_per_step']:8.2f} "
                  f"{_fmt(_ratio(rows.get('hand-eager'), row, 'ms_per_step'), '8.3f')} "
                  f"{_fmt(_ratio(compiled, row, 'ms_per_step'), '8.3f')} {row['first_call_s']:10.1f} "
                  f"{_fmt(warm_ratio, '13.2f')} {_fmt(row['graphs'], '6d')} {row['last_loss']:9.5f}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=3, help="calls before the timing (the first compiles)")
    parser.add_argument("--profile-steps", type=int, default=2, help="steps under torch.profiler")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--image-size", type=int, default=32, help="CycleGAN images (DCGAN: 16x16)")
    parser.add_argument("--filters", type=int, default=4, help="first layer's filters of every network")
    parser.add_argument("--residual-blocks", type=int, default=1, help="CycleGAN generators' residual blocks")
    parser.add_argument("--batch", type=int, default=8, help="DCGAN batch (CycleGAN: 1, the tutorial's)")
    parser.add_argument("--latent", type=int, default=16, help="DCGAN generator's input channels")
    parser.add_argument("--fused-adam", action="store_true",
                        help="Adam(fused=True): torch runs its step eagerly, td.function compiles no optimizer graph")
    parser.add_argument("--child-timeout", type=int, default=900, help="seconds per process")
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.child:
        child(*args.child, args)
        return
    models = [m for m in args.models.split(",") if m]
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(models) - set(MODELS)) + sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown steps or variants {unknown}: steps {MODELS}, variants {VARIANTS}")
    started = time.perf_counter()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for model in models:
        for variant in variants:
            t0 = time.perf_counter()
            results.setdefault(model, {})[variant] = row = spawn(model, variant, args)
            print(f"[profile_gan_steps_cpu] {model} {variant}: {row.get('status')} "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    report(results, args)
    print(RESULT + json.dumps({"torch": torch.__version__, "threads": args.threads, "steps": args.steps,
                               "warmup": args.warmup, "total_s": time.perf_counter() - started,
                               "median_ms": {m: statistics.median([r["ms_per_step"] for r in rows.values()
                                                                   if r.get("status") == "ok"] or [0])
                                             for m, rows in results.items()},
                               "results": results}))


if __name__ == "__main__":
    main()
