"""GPU: one CycleGAN training step at the TensorFlow tutorial's size, hand-written PyTorch
(eager and ``torch.compile``) vs torch-distribute (``OneDeviceStrategy`` eager and under
``td.function``, ``MirroredStrategy`` with 2 replicas on one GPU).

Goal: an epoch of horse2zebra (1,067 steps at batch 1) in at most 40 s on one H100, i.e.
about 37 ms/step; before: ~160 ms/step, ~170 s an epoch, eager (README, CycleGAN section).

The step is ``examples/cyclegan``'s: 256x256 images, ResNet generators with 64 filters and 9
residual blocks, 70x70 PatchGAN discriminators with 64 filters, LSGAN + cycle (lambda 10) +
identity losses, four Adam optimizers (2e-4, beta_1 0.5), batch 1 per replica. One forward
pass of the four networks, then four ``backward(inputs=<that network's parameters>)`` (each
network gets the gradient of its own objective only), then the four optimizer steps. The
images are random, made on the host before the timed loop (a few distinct pairs, cycled);
every variant moves them to the GPU inside the timed loop. Models are built with the same
seed (``build_cyclegan`` of ``examples/cyclegan/steps.py``).

Variants (``--variants``, comma-separated; default: the first five):

* ``hand-eager``: the plain PyTorch step on ``cuda:0`` (models built outside any strategy,
  ``per_sample_losses`` of the example, each loss ``sum / global batch``).
* ``hand-compiled``: the same with each of the four networks ``torch.compile``d
  (``--hand-mode``, default torch's default mode). Compiling the networks rather than the
  loss function keeps one compiled autograd node per network call, so each of the four
  ``backward(inputs=...)`` runs only the backward kernels it needs.
* ``one-eager``: ``td.OneDeviceStrategy("cuda:0")``, ``strategy.run(make_train_step(...))``.
* ``one-function``: the same with the distributed step wrapped in ``td.function``
  (``dynamic=False``, as ``examples/cyclegan/train.py --compile``; ``--td-mode``, default the
  library's choice: CUDA graphs for one GPU replica per process). The scope made four
  networks, so td.function compiles each network's forward as a graph of its own and the
  code between them (the losses, the optimizer steps) as the graphs around them: each of
  the four ``backward(inputs=...)`` runs only the backward graphs of the network calls it
  reaches, as eager does.
* ``mirrored2``: ``td.MirroredStrategy`` with 2 replicas on the one GPU (2 logical GPUs from
  ``td.config.set_logical_device_configuration``), global batch 2, eager. Reported
  "unavailable" where this torch-distribute has no ``td.config`` logical devices.
* extra, not in the default set: ``hand-compiled-step``: ``torch.compile`` on the loss
  function (the forward of all four networks and the losses in one graph; each of the four
  ``backward`` calls then runs that graph's whole backward); ``one-function-whole``:
  ``one-function`` with ``split_networks=False``, the replica step's whole forward as one
  graph (what ``td.function`` compiled before it split at networks: the same backward work
  as ``hand-compiled-step``, 208 convolution backward kernels a step against eager's 72 at
  the CPU check's size); ``mirrored2-function``: ``mirrored2`` under ``td.function`` (no CUDA
  graphs: replicas share the process).

Options applying to every variant: ``--bf16`` (the forward pass and the losses under
``torch.autocast(dtype=torch.bfloat16)``, backward and optimizer steps outside it) and
``--channels-last`` (the networks' weights and the images in ``torch.channels_last``).
``--all-options`` runs the four combinations {fp32, bf16} x {contiguous, channels_last} in
one invocation (four times the processes: ~15 min with the defaults; to keep it short, e.g.
``--all-options --rounds 1 --variants hand-eager,hand-compiled,one-function``).
``torch.backends.cudnn.benchmark`` is on in every variant (``--no-cudnn-benchmark``: off).
``--fused-adam``: the four Adam optimizers with ``fused=True`` (one kernel per step).

``--profile``: after its timed steps, each process profiles ``PROFILE_STEPS`` more with
``torch.profiler`` (CPU, and CUDA on a GPU) and reports the ops that cost the most (self
device time on a GPU, self CPU time on the CPU), the convolution backward kernels per step
(eager's count where each ``backward(inputs=...)`` runs only the networks it reaches; more
where a compiled graph spans several networks: ``one-function-whole``,
``hand-compiled-step``), the host syncs per step (``item`` calls and CUDA synchronizations)
and dynamo's graph breaks with their reasons.

``--numerics-reference``: every variant records its ``loss_G/total`` at every step (kept on
the device, read after the timing), and one more process runs ``hand-eager`` in float32,
contiguous, with Adam unfused, for as many steps from the same weights and images: for each
variant the report gives the first step's relative difference from it (the same weights: the
precision alone), the relative difference of the mean over the last 50 steps, and whether
every loss stayed finite. A few hundred steps (``--warmup 10 --steps 190``) check that the
faster settings train alike; GAN losses wander, so a few percent on the late mean is normal.

Each (options, variant) pair runs in its own process, ``--rounds`` times, interleaved (in
each round every option combination, and within it every variant, in turn). A process runs
``--warmup`` untimed steps (compilation and CUDA-graph recording included: reported as the
warm-up seconds, and the first step alone), synchronises, then times ``--steps`` steps and
synchronises again. Reported per variant: the median ms/step over the rounds, the projected
seconds for an epoch of horse2zebra (``1067 // global batch`` steps), the speedup over
``hand-eager`` and over ``hand-compiled`` (their epoch time / this variant's: above 1 is
faster; per epoch, so ``mirrored2``'s global batch of 2 counts), the warm-up seconds, the
graphs dynamo compiled and ``td.function``'s ``experimental_get_tracing_count()``, the peak
GPU memory, and the last step's ``loss_G/total`` (a sanity check: equal seeds, so variants
should be close). A variant whose process fails is reported as failed (with the end of its
error) and the others go on; each finished process prints a progress line to stderr.

Budget with the defaults (5 variants x 2 rounds x 30 timed steps): about 4-5 minutes on one
H100, most of it the first round's compilation (``hand-compiled`` and ``one-function``,
maybe 30-90 s each on 16 cores; the second round reads inductor's cache). ``--rounds 1``
about halves it.

    python benchmarks/bench_cyclegan_gpu.py                              # defaults, float32
    python benchmarks/bench_cyclegan_gpu.py --bf16 --channels-last
    python benchmarks/bench_cyclegan_gpu.py --variants hand-compiled-step,one-function --rounds 1
    python benchmarks/bench_cyclegan_gpu.py --device cpu --image-size 32 --generator-filters 8 \\
        --residual-blocks 1 --steps 2 --warmup 1 --rounds 1              # a check of the script

Without CUDA it exits with a message (``--device cpu`` only checks that the script runs; its
numbers mean nothing; mirrored2 then uses ``cpu:0,cpu:1``). The last line printed is
``CYCLEGANBENCH {json}`` with every number.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)  # examples.cyclegan, and torch_distribute from this checkout

import torch  # noqa: E402

RESULT = "CYCLEGANBENCH "
PROFILE_RESULT = "CYCLEGANPROFILE "
HORSE2ZEBRA_STEPS = 1067  # trainA; the tutorial zips the two domains (batch 1)
GOAL_EPOCH_S = 40.0
VARIANTS = ("hand-eager", "hand-compiled", "one-eager", "one-function", "mirrored2",
            "hand-compiled-step", "mirrored2-function", "one-function-whole")
DEFAULT_VARIANTS = VARIANTS[:5]
HOST_PAIRS = 4  # distinct random image pairs, cycled
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
PROFILE_STEPS = 5
PROFILE_ROWS = 15
NUMERICS_REFERENCE = "fp32-eager-reference"  # the extra process of --numerics-reference
LATE_STEPS = 50  # the late mean of --numerics-reference


def _log(message: str) -> None:
    print(f"[bench_cyclegan_gpu] {message}", file=sys.stderr, flush=True)


# -- one variant, in a child process ---------------------------------------------------------
class Unavailable(Exception):
    """The variant cannot run with this torch-distribute (reported, not a failure)."""


def _model_config(args: argparse.Namespace) -> Any:
    from examples.cyclegan.models import ModelConfig

    return ModelConfig(image_size=args.image_size, generator_filters=args.generator_filters,
                       residual_blocks=args.residual_blocks,
                       discriminator_filters=args.discriminator_filters,
                       discriminator_layers=args.discriminator_layers).validate()


def _host_batches(args: argparse.Namespace, global_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``warmup + steps`` pairs of host images in [-1, 1], cycling over a few random ones."""
    generator = torch.Generator().manual_seed(1)
    shape = (global_batch, 3, args.image_size, args.image_size)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    pool = [tuple((torch.rand(shape, generator=generator) * 2 - 1).contiguous(memory_format=memory_format)
                  for _ in range(2)) for _ in range(HOST_PAIRS)]
    return [pool[i % HOST_PAIRS] for i in range(args.warmup + args.steps)]  # type: ignore[misc]


def _compile_kwargs(mode: str | None) -> dict[str, Any]:
    return {} if mode in (None, "default") else {"mode": mode}


def _hand_runner(variant: str, args: argparse.Namespace, device: torch.device, autocast_dtype: Any):
    """Plain PyTorch: no strategy anywhere."""
    from examples.cyclegan.steps import LOSS_KEYS, build_cyclegan, per_sample_losses

    global_batch = args.batch_size
    torch.manual_seed(0)
    gan = build_cyclegan(_model_config(args), fused=True if args.fused_adam else None)  # outside any scope
    memory_format = torch.channels_last if args.channels_last else torch.preserve_format
    for model in gan.models().values():
        model.to(device, memory_format=memory_format)  # same Parameter objects: optimizers keep them
    forward_gan = gan
    if variant == "hand-compiled":
        compiled = {name: torch.compile(model, dynamic=False, **_compile_kwargs(args.hand_mode))
                    for name, model in gan.models().items()}
        forward_gan = dataclasses.replace(gan, **compiled)
    objectives = (("loss_G/total", gan.generator_g), ("loss_F/total", gan.generator_f),
                  ("loss_X/loss", gan.discriminator_x), ("loss_Y/loss", gan.discriminator_y))
    params = {key: list(model.parameters()) for key, model in objectives}

    def losses_of(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        region = (contextlib.nullcontext() if autocast_dtype is None
                  else torch.autocast(device.type, dtype=autocast_dtype))
        with region:
            per_sample = per_sample_losses(forward_gan, x, y)
        return {key: per_sample[key].float().sum() / global_batch for key in LOSS_KEYS}

    if variant == "hand-compiled-step":
        losses_of = torch.compile(losses_of, dynamic=False, **_compile_kwargs(args.hand_mode))

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = (t.to(device, non_blocking=True) for t in batch)
        losses = losses_of(x, y)
        for i, (key, _) in enumerate(objectives):
            losses[key].backward(inputs=params[key], retain_graph=i < len(objectives) - 1)
        for optimizer in gan.optimizers():
            optimizer.step()
        for optimizer in gan.optimizers():
            optimizer.zero_grad()
        return losses["loss_G/total"].detach()

    return step, _host_batches(args, global_batch), None, global_batch


def _mirrored2_strategy(args: argparse.Namespace, device: torch.device) -> Any:
    import torch_distribute as td

    if device.type != "cuda":
        return td.MirroredStrategy(["cpu:0", "cpu:1"])
    config = getattr(td, "config", None)
    needed = ("list_physical_devices", "set_logical_device_configuration", "LogicalDeviceConfiguration")
    missing = [name for name in needed if not hasattr(config, name)]
    if missing:
        raise Unavailable(f"this torch_distribute has no td.config.{missing[0]} (logical GPUs)")
    gpus = config.list_physical_devices("GPU")
    physical = gpus[device.index or 0]
    config.set_logical_device_configuration(
        physical, [config.LogicalDeviceConfiguration(), config.LogicalDeviceConfiguration()])
    strategy = td.MirroredStrategy() if len(gpus) == 1 else td.MirroredStrategy(["cuda:0", "cuda:1"])
    if strategy.num_replicas_in_sync != 2:
        raise Unavailable(f"td.MirroredStrategy() made {strategy.num_replicas_in_sync} replicas, not 2")
    return strategy


def _strategy_runner(variant: str, args: argparse.Namespace, device: torch.device, autocast_dtype: Any):
    import torch_distribute as td
    from examples.cyclegan.steps import build_cyclegan, make_train_step

    if variant.startswith("mirrored2"):
        strategy = _mirrored2_strategy(args, device)
    else:
        strategy = td.OneDeviceStrategy(str(device))
    global_batch = args.batch_size * strategy.num_replicas_in_sync
    with strategy.scope():
        torch.manual_seed(0)
        gan = build_cyclegan(_model_config(args), fused=True if args.fused_adam else None)
        if args.channels_last:  # in the scope: the replicas' copies are made from these
            for model in gan.models().values():
                model.to(memory_format=torch.channels_last)
    train_step = make_train_step(gan, global_batch, autocast_dtype=autocast_dtype)

    def distributed_train_step(x: Any, y: Any) -> torch.Tensor:
        per_replica = strategy.run(train_step, args=(x, y))
        return strategy.reduce(td.ReduceOp.SUM, per_replica["loss_G/total"], axis=None)

    function = None
    if "-function" in variant:
        mode = None if args.td_mode == "auto" else args.td_mode
        # -whole: one graph for the replica step (what td.function compiled before it split at networks)
        split = {"split_networks": False} if variant.endswith("-whole") else {}
        function = distributed_train_step = td.function(distributed_train_step, mode=mode, dynamic=False, **split)

    def step(batch: tuple[Any, Any]) -> torch.Tensor:
        return distributed_train_step(*batch)

    batches = strategy.experimental_distribute_dataset(_host_batches(args, global_batch))
    return step, batches, function, global_batch


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(device)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    autocast_dtype = torch.bfloat16 if args.bf16 else None
    build = _hand_runner if variant.startswith("hand") else _strategy_runner
    try:
        step, batches, function, global_batch = build(variant, args, device, autocast_dtype)
    except Unavailable as e:
        return {"status": "unavailable", "reason": str(e)}
    synchronize = torch.cuda.synchronize if on_gpu else (lambda: None)
    iterator = iter(batches)
    started = time.perf_counter()
    loss = first_loss = step(next(iterator)).detach()
    synchronize()
    first_step_s = time.perf_counter() - started
    warmup_losses = []
    for _ in range(args.warmup - 1):
        loss = step(next(iterator))
        warmup_losses.append(loss.detach())
    synchronize()
    warmup_s = time.perf_counter() - started
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    losses = [first_loss, *warmup_losses]
    started = time.perf_counter()
    for batch in iterator:
        loss = step(batch)
        if args.numerics_reference:
            losses.append(loss.detach())  # read after the timing: no host sync per step
    synchronize()
    seconds = (time.perf_counter() - started) / args.steps
    extra: dict[str, Any] = {}
    if args.numerics_reference:
        extra["losses"] = [float(value) for value in losses]
    if args.profile:  # after the timings are out: a profiler failure loses only the profile
        extra["profile_later"] = lambda: _profile(step, batches, synchronize, on_gpu)
    return {**extra,
        "status": "ok",
        "ms_per_step": seconds * 1e3,
        "global_batch": global_batch,
        "first_step_s": first_step_s,
        "warmup_s": warmup_s,
        "graphs": int(counters["stats"]["unique_graphs"]),
        "tracing_count": function.experimental_get_tracing_count() if function is not None else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else None,
        "last_loss_G_total": float(loss),
    }


def _profile(step: Any, batches: Any, synchronize: Any, on_gpu: bool) -> dict[str, Any]:
    """``PROFILE_STEPS`` more steps under ``torch.profiler``: the costliest ops, convolution
    backward kernels and host syncs per step, and dynamo's graph breaks so far."""
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    iterator = iter(batches)
    with profile(activities=activities) as prof:
        for _ in range(PROFILE_STEPS):
            batch = next(iterator, None)
            if batch is None:  # fewer batches than steps to profile: start them again
                iterator = iter(batches)
                batch = next(iterator)
            step(batch)
        synchronize()
    calls: dict[str, int] = {}
    for event in prof.events():
        calls[event.name] = calls.get(event.name, 0) + 1
    sort_by = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    breaks = {reason.splitlines()[0][:160]: int(count) for reason, count in counters["graph_break"].items()}
    return {
        "table": prof.key_averages().table(sort_by=sort_by, row_limit=PROFILE_ROWS),
        "per_step": {name: calls.get(name, 0) / PROFILE_STEPS for name in (
            "aten::convolution_backward", "aten::convolution", "aten::_local_scalar_dense",
            "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaGraphLaunch")},
        "graph_breaks": breaks,
    }


# -- the parent: processes, rounds, medians ----------------------------------------------------
def _combos(args: argparse.Namespace) -> list[tuple[bool, bool]]:
    """(bf16, channels_last) pairs to run."""
    if args.all_options:
        return [(bf16, cl) for bf16 in (False, True) for cl in (False, True)]
    return [(args.bf16, args.channels_last)]


def _combo_name(bf16: bool, channels_last: bool) -> str:
    return f"{'bf16' if bf16 else 'fp32'}/{'channels_last' if channels_last else 'contiguous'}"


def _child_command(variant: str, bf16: bool, channels_last: bool, args: argparse.Namespace) -> list[str]:
    command = [sys.executable, HERE, "--child", variant, "--device", args.device,
               "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--image-size", str(args.image_size), "--generator-filters", str(args.generator_filters),
               "--residual-blocks", str(args.residual_blocks),
               "--discriminator-filters", str(args.discriminator_filters),
               "--discriminator-layers", str(args.discriminator_layers),
               "--batch-size", str(args.batch_size), "--hand-mode", args.hand_mode,
               "--td-mode", args.td_mode]
    if bf16:
        command.append("--bf16")
    if channels_last:
        command.append("--channels-last")
    if not args.cudnn_benchmark:
        command.append("--no-cudnn-benchmark")
    if args.fused_adam and variant != NUMERICS_REFERENCE:
        command.append("--fused-adam")
    for flag in ("profile", "numerics_reference"):
        if getattr(args, flag) and not (flag == "profile" and variant == NUMERICS_REFERENCE):
            command.append("--" + flag.replace("_", "-"))
    if variant == NUMERICS_REFERENCE:  # the reference runs as hand-eager
        command[command.index("--child") + 1] = "hand-eager"
    return command


def spawn(variant: str, bf16: bool, channels_last: bool, args: argparse.Namespace) -> dict[str, Any]:
    command = _child_command(variant, bf16, channels_last, args)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=args.child_timeout)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-1500:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"status": "failed", "reason": f"no result in {args.child_timeout} s (--child-timeout)",
                "stderr_tail": tail}
    found: dict[str, Any] | None = None
    for line in out.stdout.splitlines():
        if line.startswith(RESULT):
            found = json.loads(line[len(RESULT):])
        elif line.startswith(PROFILE_RESULT) and found is not None:
            found["profile"] = json.loads(line[len(PROFILE_RESULT):])
    if found is not None:
        if args.profile and "profile" not in found and found.get("status") == "ok":
            found["profile"] = {"table": f"(the profile failed: exit status {out.returncode})\n"
                                         + out.stderr[-1500:], "per_step": {}, "graph_breaks": {}}
        return found
    return {"status": "failed", "reason": f"exit status {out.returncode}",
            "stderr_tail": (out.stdout[-500:] + out.stderr[-2500:])}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per combo and variant: medians over the rounds that succeeded, and the speedups."""
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for combo, by_variant in runs.items():
        rows: dict[str, dict[str, Any]] = {}
        for variant, results in by_variant.items():
            ok = [r for r in results if r.get("status") == "ok"]
            if not ok:
                last = results[-1] if results else {"status": "failed", "reason": "not run"}
                rows[variant] = {"status": last["status"], "reason": last.get("reason"),
                                 "stderr_tail": last.get("stderr_tail")}
                continue
            ms = _median([r["ms_per_step"] for r in ok])
            global_batch = ok[0]["global_batch"]
            rows[variant] = {
                "status": "ok" if len(ok) == len(results) else f"ok in {len(ok)}/{len(results)} rounds",
                "ms_per_step": ms,
                "rounds_ms_per_step": [r["ms_per_step"] for r in ok],
                "global_batch": global_batch,
                "epoch_s": ms / 1e3 * (HORSE2ZEBRA_STEPS // global_batch),
                "first_step_s": _median([r["first_step_s"] for r in ok]),
                "warmup_s": _median([r["warmup_s"] for r in ok]),
                "warmup_s_rounds": [r["warmup_s"] for r in ok],
                "graphs": ok[0]["graphs"],
                "tracing_count": ok[0]["tracing_count"],
                "peak_memory_gib": ok[0]["peak_memory_gib"],
                "last_loss_G_total": ok[0]["last_loss_G_total"],
                **{key: ok[0][key] for key in ("profile", "losses") if key in ok[0]},
            }
        for baseline in ("hand-eager", "hand-compiled"):
            base = rows.get(baseline, {}).get("epoch_s")
            for row in rows.values():
                if "epoch_s" in row:
                    row[f"speedup_vs_{baseline}"] = base / row["epoch_s"] if base else None
        summary[combo] = rows
    return summary


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(summary: dict[str, dict[str, dict[str, Any]]], header: str) -> None:
    print(header)
    columns = (f"{'options':<22} {'variant':<19} {'ms/step':>8} {'epoch s':>8} {'vs eager':>8} "
               f"{'vs comp.':>8} {'warm-up s':>9} {'1st step s':>10} {'graphs':>6} {'traces':>6} "
               f"{'GiB':>5} {'loss_G':>8}")
    print(columns)
    for combo, rows in summary.items():
        for variant, row in rows.items():
            if "ms_per_step" not in row:
                print(f"{combo:<22} {variant:<19} {row['status']}: {row.get('reason')}")
                continue
            print(f"{combo:<22} {variant:<19} {row['ms_per_step']:8.2f} {row['epoch_s']:8.1f} "
                  f"{_fmt(row['speedup_vs_hand-eager'], '8.3f')} {_fmt(row['speedup_vs_hand-compiled'], '8.3f')} "
                  f"{row['warmup_s']:9.1f} {row['first_step_s']:10.1f} {row['graphs']:6d} "
                  f"{_fmt(row['tracing_count'], '6d')} {_fmt(row['peak_memory_gib'], '5.1f')} "
                  f"{row['last_loss_G_total']:8.4f}")
    for combo, rows in summary.items():
        for variant, row in rows.items():
            if "rounds_ms_per_step" in row:
                print(f"rounds {combo} {variant}: "
                      + ", ".join(f"{t:.2f}" for t in row["rounds_ms_per_step"]) + " ms/step; warm-up "
                      + ", ".join(f"{t:.1f}" for t in row["warmup_s_rounds"]) + " s")
            elif row.get("stderr_tail"):
                print(f"--- {combo} {variant} {row['status']}: end of its output ---\n{row['stderr_tail']}")
    for combo, rows in summary.items():
        for variant, row in rows.items():
            profiled = row.get("profile")
            if profiled:
                per_step = ", ".join(f"{name} {count:g}" for name, count in profiled["per_step"].items())
                print(f"--- profile {combo} {variant}: per step {per_step}; graph breaks "
                      f"{profiled['graph_breaks'] or 'none'}\n{profiled['table']}")
    met = [f"{combo} {variant} ({row['epoch_s']:.1f} s)" for combo, rows in summary.items()
           for variant, row in rows.items() if row.get("epoch_s") is not None and row["epoch_s"] <= GOAL_EPOCH_S]
    print(f"goal (an epoch of horse2zebra <= {GOAL_EPOCH_S:.0f} s): "
          + (", ".join(met) if met else "met by no variant"))


def numerics(summary: dict[str, dict[str, dict[str, Any]]], reference: dict[str, Any]) -> dict[str, Any]:
    """Each variant's ``loss_G/total`` per step against the float32 eager reference's."""
    expected = reference.get("losses") if reference.get("status") == "ok" else None
    found: dict[str, Any] = {}
    if not expected:
        return {"reference": reference.get("status", "failed"), "reason": reference.get("reason")}
    late_expected = statistics.fmean(expected[-LATE_STEPS:])
    for combo, rows in summary.items():
        for variant, row in rows.items():
            losses = row.get("losses")
            if not losses:
                continue
            late = statistics.fmean(losses[-LATE_STEPS:])
            found[f"{combo} {variant}"] = {
                "steps": len(losses),
                "first_step_relative_difference": abs(losses[0] - expected[0]) / abs(expected[0]),
                "late_mean": late, "reference_late_mean": late_expected,
                "late_mean_relative_difference": abs(late - late_expected) / abs(late_expected),
                "all_finite": all(math.isfinite(value) for value in losses),
            }
    return found


def print_numerics(found: dict[str, Any]) -> None:
    if "reference" in found:
        print(f"numerics: the float32 eager reference {found['reference']}: {found.get('reason')}")
        return
    for name, row in found.items():
        print(f"numerics {name} vs float32 eager over {row['steps']} steps: first step's loss_G relative "
              f"difference {row['first_step_relative_difference']:.2e}; mean of the last {LATE_STEPS} "
              f"{row['late_mean']:.4f} vs {row['reference_late_mean']:.4f} (relative difference "
              f"{row['late_mean_relative_difference']:.3f}); every loss finite: {row['all_finite']}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Without CUDA it exits with a message; --device cpu only checks that the script runs.")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation included)")
    parser.add_argument("--rounds", type=int, default=2, help="processes per (options, variant); medians")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast over forward and losses")
    parser.add_argument("--channels-last", action="store_true", help="networks and images channels_last")
    parser.add_argument("--all-options", action="store_true",
                        help="run {fp32, bf16} x {contiguous, channels_last} (4x the processes)")
    parser.add_argument("--device", default="cuda:0", help="cpu only checks that the script runs")
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--generator-filters", type=int, default=64)
    parser.add_argument("--residual-blocks", type=int, default=9)
    parser.add_argument("--discriminator-filters", type=int, default=64)
    parser.add_argument("--discriminator-layers", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=1, help="images per replica and step")
    parser.add_argument("--hand-mode", choices=COMPILE_MODES, default="default",
                        help="torch.compile mode of hand-compiled and hand-compiled-step")
    parser.add_argument("--td-mode", choices=("auto", *COMPILE_MODES), default="auto",
                        help="td.function mode (auto: the library's choice, CUDA graphs for one GPU replica)")
    parser.add_argument("--fused-adam", action="store_true", help="Adam(fused=True) for the four optimizers")
    parser.add_argument("--profile", action="store_true",
                        help=f"profile {PROFILE_STEPS} more steps per process: top ops, host syncs, graph breaks")
    parser.add_argument("--numerics-reference", action="store_true",
                        help="record loss_G every step and compare with a float32 eager run of as many steps")
    parser.add_argument("--no-cudnn-benchmark", dest="cudnn_benchmark", action="store_false",
                        help="leave torch.backends.cudnn.benchmark off")
    parser.add_argument("--child-timeout", type=int, default=600, help="seconds per process")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1:
        parser.error("--steps, --warmup and --rounds must be >= 1")
    if args.child:
        result = run_variant(args.child, args)
        profile_later = result.pop("profile_later", None)
        print(RESULT + json.dumps(result), flush=True)
        if profile_later is not None:
            print(PROFILE_RESULT + json.dumps(profile_later()), flush=True)
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench_cyclegan_gpu.py needs a CUDA GPU and torch.cuda.is_available() is False here. "
                 "(--device cpu only checks that the script runs; its numbers mean nothing.)")
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}: use some of {', '.join(VARIANTS)}")
    try:
        _model_config(args)
    except ValueError as e:
        parser.error(str(e))

    combos = _combos(args)
    runs = {_combo_name(*c): {v: [] for v in variants} for c in combos}
    started = time.perf_counter()
    for round_index in range(args.rounds):
        for bf16, channels_last in combos:
            combo = _combo_name(bf16, channels_last)
            for variant in variants:
                t0 = time.perf_counter()
                result = spawn(variant, bf16, channels_last, args)
                runs[combo][variant].append(result)
                what = (f"{result['ms_per_step']:.2f} ms/step, warm-up {result['warmup_s']:.1f} s"
                        if result.get("status") == "ok" else f"{result['status']}: {result.get('reason')}")
                _log(f"round {round_index + 1}/{args.rounds} {combo} {variant}: {what} "
                     f"(process {time.perf_counter() - t0:.0f} s, total {time.perf_counter() - started:.0f} s)")

    found: dict[str, Any] = {}
    if args.numerics_reference:
        t0 = time.perf_counter()
        reference = spawn(NUMERICS_REFERENCE, False, False, args)
        _log(f"{NUMERICS_REFERENCE}: {reference.get('status')} (process {time.perf_counter() - t0:.0f} s)")
    summary = summarize(runs)
    if args.numerics_reference:
        found = numerics(summary, reference)
    on_gpu = args.device.startswith("cuda")
    name = torch.cuda.get_device_name(torch.device(args.device)) if on_gpu else "CPU (a check of the script)"
    size = (f"{args.image_size}x{args.image_size}, generator {args.generator_filters} filters "
            f"{args.residual_blocks} blocks, discriminator {args.discriminator_filters} filters")
    print_table(summary, (
        f"# {name}, torch {torch.__version__}, CycleGAN {size}, batch {args.batch_size} per replica; "
        f"{args.steps} timed steps after {args.warmup} warm-up steps x {args.rounds} rounds, medians; "
        f"epoch s: ms/step x {HORSE2ZEBRA_STEPS} // global batch; vs eager / vs comp.: hand-eager's / "
        f"hand-compiled's epoch time over this variant's (above 1: faster); hand-compiled: "
        f"torch.compile on each network (mode {args.hand_mode}); td.function mode {args.td_mode}; "
        f"cudnn.benchmark {args.cudnn_benchmark}; Adam {'fused' if args.fused_adam else 'default'}"))
    if args.numerics_reference:
        print_numerics(found)
    print(RESULT + json.dumps({
        "device": name, "torch": torch.__version__, "image_size": args.image_size,
        "generator_filters": args.generator_filters, "residual_blocks": args.residual_blocks,
        "discriminator_filters": args.discriminator_filters, "batch_size_per_replica": args.batch_size,
        "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "variants": variants,
        "hand_mode": args.hand_mode, "td_mode": args.td_mode, "cudnn_benchmark": args.cudnn_benchmark,
        "goal_epoch_s": GOAL_EPOCH_S, "epoch_steps_at_batch_1": HORSE2ZEBRA_STEPS,
        "fused_adam": args.fused_adam, "numerics": found,
        "total_s": time.perf_counter() - started,
        "results": {combo: {variant: {k: v for k, v in row.items() if k not in ("profile", "losses")}
                            for variant, row in rows.items()} for combo, rows in summary.items()},
    }))


if __name__ == "__main__":
    main()
