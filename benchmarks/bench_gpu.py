"""GPU: our strategies on one CUDA device vs the hand-written loop and vs DDP (NCCL, 1 rank),
in float32, bfloat16 autocast and float16 autocast with a GradScaler.

A small ResNet-style CNN on synthetic 3x32x32 images, Adam, global batch 256. Every
(precision, variant) pair runs in its own process, several rounds, alternating (in each
round every precision, and within it every variant, in turn), and reports milliseconds per
step (CUDA-synchronised after the warmup and after the timed steps). The table gives, per
precision, the median ms/step of each variant and the throughput ratio hand-written /
variant (above 1: the variant is faster), both from the rounds of this one invocation.

Precisions (``--precision``, default ``all``: the three in one invocation, one table; or a
comma-separated list of them):

* ``float32``: no autocast.
* ``bf16``: the forward pass and the loss under ``torch.autocast("cuda", dtype=torch.bfloat16)``.
* ``fp16``: the same under ``torch.float16``, with a ``torch.amp.GradScaler("cuda")`` (default
  settings) used as PyTorch documents it: ``scaler.scale(loss).backward()``,
  ``scaler.step(optimizer)``, ``scaler.update()``, ``optimizer.zero_grad()``. The strategy
  variants make the same calls inside ``strategy.run``; DDP uses a GradScaler too. The loss
  scale after the warmup and after the timed steps is reported per variant (a halving is a
  skipped step; they should agree across variants).

Variants (``--variants``, comma-separated):

* ``hand``: the plain PyTorch loop on ``cuda:0``.
* ``one``: ``td.OneDeviceStrategy("cuda:0")``, ``strategy.run`` over a distributed dataset.
* ``central``: ``td.CentralStorageStrategy(["cuda:0"], parameter_device="cpu")``: parameters
  and Adam state on the host, compute on the GPU (gradients to the host, values back).
* ``mwms``: ``td.MultiWorkerMirroredStrategy`` with one worker on ``cuda:0``, started by
  ``torch_distribute.launch``. With one worker nothing crosses processes (no process group
  is made), so this measures the strategy's own cost on the GPU, not NCCL.
* ``ddp``: ``DistributedDataParallel`` with one NCCL rank on ``cuda:0`` (its reducer still
  copies every gradient into a bucket and all-reduces it over the one rank).
* ``mirrored2``: ``td.MirroredStrategy()`` over 2 logical GPUs of the one card
  (``td.config.set_logical_device_configuration``): 2 replicas in one process, each on half
  the global batch. On the CPU (a check of the script): ``cpu:0,cpu:1``.
* ``hand-compiled``: ``hand`` with the model under ``torch.compile`` (torch's default mode),
  the loss, backward and optimizer step eager: the compiled loop a PyTorch user writes.
* ``one-function``: ``one`` with the distributed step under ``@td.function`` (the library's
  choice of mode: CUDA graphs for one GPU replica per process). With ``hand-compiled`` it
  answers whether ``td.function`` is at least as fast as compiling by hand; both report their
  warm-up seconds (the first ``--warmup`` steps, compilation included).
* ``one-function-split``: ``one-function`` with ``split_networks=True``: the model's forward a
  graph of its own, the loss and Adam's update the graphs after it (the default keeps a scope
  with one network in one graph per step): whether splitting pays for a single network too.
* ``ddp2``: its fair baseline, ``DistributedDataParallel`` with 2 processes sharing the card
  (started by torchrun), each on half the global batch. NCCL refuses two ranks on one GPU, so
  the ranks use Gloo (gradients cross through the host). Rank 0's time is reported.

Every variant moves its host batches to the GPU inside the timed loop.

Run on a GPU machine (without CUDA it exits with a message; ``--device cpu`` only checks that
the script runs)::

    python benchmarks/bench_gpu.py                        # all precisions, 50 steps x 3 rounds
    python benchmarks/bench_gpu.py --precision fp16 --steps 30 --rounds 2 --variants hand,one,ddp

The last line printed is ``GPUBENCH {json}`` with every number (medians, each round's time,
ratios, fp16 loss scales).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

GLOBAL_BATCH = 256
HERE = os.path.abspath(__file__)
RESULT = "GPUBENCH "
PRECISIONS = ("float32", "bf16", "fp16")
AUTOCAST_DTYPES = {"float32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
VARIANTS = ("hand", "one", "central", "mwms", "ddp", "mirrored2", "ddp2", "hand-compiled", "one-function",
            "one-function-split")
DEFAULT_VARIANTS = ("hand", "one", "central", "mwms", "ddp")


class Block(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), Block(64), Block(64), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), Block(128), Block(128), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(128, 10),
    )


def make_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (GLOBAL_BATCH,), generator=gen)
    return [(x, y)] * n


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str) -> torch.Tensor:
    """Per-example losses; the forward pass and the loss under autocast, as PyTorch documents
    (cross_entropy autocasts to float32 by itself)."""
    dtype = AUTOCAST_DTYPES[precision]
    region = contextlib.nullcontext() if dtype is None else torch.autocast(x.device.type, dtype=dtype)
    with region:
        return F.cross_entropy(model(x), y, reduction="none")


def backward_and_step(loss: torch.Tensor, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
    """The same calls in every variant (inside ``strategy.run`` for ours)."""
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    opt.zero_grad()


def run_variant(variant: str, steps: int, warmup: int, precision: str, device_name: str) -> dict:
    """Seconds per step of one variant in this process (and, for fp16, the loss scale)."""
    batches = make_batches(warmup + steps)
    on_gpu = device_name.startswith("cuda")
    # Where the loss is computed (the compute device, also for central storage).
    scaler = torch.amp.GradScaler(torch.device(device_name).type) if precision == "fp16" else None
    if variant in ("hand", "ddp", "ddp2", "hand-compiled"):
        device = torch.device(device_name)
        model = make_model().to(device)
        rows = slice(None)
        forward = torch.compile(model) if variant == "hand-compiled" else model
        if variant == "ddp":
            import torch.distributed as dist

            dist.init_process_group("nccl" if on_gpu else "gloo", rank=0, world_size=1)
            model = nn.parallel.DistributedDataParallel(model, device_ids=[0] if on_gpu else None)
        elif variant == "ddp2":  # torchrun's variables; Gloo: NCCL refuses two ranks on one GPU
            import torch.distributed as dist

            dist.init_process_group("gloo")
            half = GLOBAL_BATCH // 2
            rows = slice(dist.get_rank() * half, (dist.get_rank() + 1) * half)
            model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index or 0] if on_gpu else None)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)

        def runner(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
            x, y = (t[rows].to(device, non_blocking=True) for t in batch)
            backward_and_step(loss_of(forward, x, y, precision).sum() / GLOBAL_BATCH, opt, scaler)

        data = batches
    else:
        import torch_distribute as td

        if variant in ("one", "one-function", "one-function-split"):
            strategy = td.OneDeviceStrategy(device_name)
        elif variant == "central":
            # On the CPU (a check of this script), compute on a second logical CPU device.
            compute = device_name if on_gpu else "cpu:1"
            strategy = td.CentralStorageStrategy([compute], parameter_device="cpu:0")
        elif variant == "mirrored2":
            strategy = _two_replica_strategy(td, on_gpu)
        else:
            strategy = td.MultiWorkerMirroredStrategy(devices=[device_name])
        with strategy.scope():
            model = make_model()
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)

        def replica_step(x: torch.Tensor, y: torch.Tensor) -> None:
            loss = td.compute_average_loss(loss_of(model, x, y, precision), global_batch_size=GLOBAL_BATCH)
            backward_and_step(loss, opt, scaler)

        def runner(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
            strategy.run(replica_step, args=batch)

        if variant == "one-function":
            runner = td.function(runner)
        elif variant == "one-function-split":
            runner = td.function(runner, split_networks=True)

        data = strategy.experimental_distribute_dataset(batches)
    # Every variant moves its host batches to the device inside the timed loop.
    batch_iterator = iter(data)
    synchronize = torch.cuda.synchronize if on_gpu else (lambda: None)
    warmup_started = time.perf_counter()
    for _ in range(warmup):
        runner(next(batch_iterator))
    synchronize()
    warmup_s = time.perf_counter() - warmup_started
    scale_after_warmup = scaler.get_scale() if scaler is not None else None
    started = time.perf_counter()
    for batch in batch_iterator:
        runner(batch)
    synchronize()
    seconds = (time.perf_counter() - started) / steps
    scales = None if scaler is None else [scale_after_warmup, scaler.get_scale()]
    peak = torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None
    return {"s_per_step": seconds, "loss_scale": scales, "peak_memory_gib": peak, "warmup_s": warmup_s}


def _two_replica_strategy(td, on_gpu: bool):
    """``td.MirroredStrategy()`` over 2 logical GPUs of the one card (CPU: ``cpu:0,cpu:1``)."""
    if not on_gpu:
        return td.MirroredStrategy(["cpu:0", "cpu:1"])
    gpu = td.config.list_physical_devices("GPU")[0]
    td.config.set_logical_device_configuration(
        gpu, [td.config.LogicalDeviceConfiguration(), td.config.LogicalDeviceConfiguration()])
    strategy = td.MirroredStrategy()
    assert strategy.num_replicas_in_sync == 2, strategy.num_replicas_in_sync
    return strategy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(variant: str, precision: str, args: argparse.Namespace) -> dict:
    child = [HERE, "--child", variant, "--precision", precision, "--steps", str(args.steps),
             "--warmup", str(args.warmup), "--device", args.device]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if variant == "mwms":
        cmd = [sys.executable, "-m", "torch_distribute.launch", "--nproc", "1", *child]
    elif variant == "ddp2":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()), *child]
    else:
        cmd = [sys.executable, *child]
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    for line in out.stdout.splitlines():
        if RESULT in line:
            return json.loads(line.split(RESULT, 1)[1])
    raise RuntimeError(f"{variant} ({precision}) failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="Without CUDA it exits with a message; --device cpu only checks that the script runs.")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per process (default 50)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="processes per (precision, variant); medians")
    parser.add_argument("--precision", default="all",
                        help="float32, bf16 (bfloat16 autocast), fp16 (float16 autocast + GradScaler), a "
                             "comma-separated list of them, or all three in one run (default)")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)} (default: {','.join(DEFAULT_VARIANTS)})")
    parser.add_argument("--device", default="cuda:0", help="cpu only checks that the script runs")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    precisions = list(PRECISIONS) if args.precision == "all" else [p for p in args.precision.split(",") if p]
    if not precisions or set(precisions) - set(PRECISIONS):
        parser.error(f"--precision takes all or some of {', '.join(PRECISIONS)}, got {args.precision!r}")
    if args.child:
        if len(precisions) != 1:
            parser.error("a child process runs one precision")
        result = run_variant(args.child, args.steps, args.warmup, args.precision, args.device)
        if os.environ.get("RANK", "0") == "0":  # ddp2: rank 0 speaks for both
            print(RESULT + json.dumps(result))
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA GPU and torch.cuda.is_available() is False here. "
                 "(--device cpu only checks that the script runs; its numbers mean nothing.)")
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}: use some of {', '.join(VARIANTS)}")
    times: dict[str, dict[str, list[float]]] = {p: {v: [] for v in variants} for p in precisions}
    loss_scales: dict[str, list[float]] = {}
    peak_gib: dict[str, dict[str, float | None]] = {p: {} for p in precisions}
    warmups: dict[str, dict[str, list[float]]] = {p: {v: [] for v in variants} for p in precisions}
    for _ in range(args.rounds):
        for precision in precisions:
            for variant in variants:
                result = spawn(variant, precision, args)
                times[precision][variant].append(result["s_per_step"] * 1e3)
                print(f"{precision} {variant}: {result['s_per_step'] * 1e3:.2f} ms/step", file=sys.stderr, flush=True)
                peak_gib[precision][variant] = result["peak_memory_gib"]
                warmups[precision][variant].append(result["warmup_s"])
                if result["loss_scale"] is not None:
                    loss_scales[variant] = result["loss_scale"]  # the last round's

    med = {p: {v: statistics.median(t) for v, t in times[p].items()} for p in precisions}
    ratio = {p: {v: med[p]["hand"] / med[p][v] for v in variants if v != "hand"} if "hand" in variants else {}
             for p in precisions}
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "CPU (a check of the script)"
    print(f"# {name}, global batch {GLOBAL_BATCH}, {args.steps} steps x {args.rounds} rounds, medians in ms/step; "
          "bf16: bfloat16 autocast; fp16: float16 autocast + GradScaler; "
          "ratio: hand-written ms / variant ms (above 1: faster than hand-written)")
    print(f"{'variant':>13}" + "".join(f" | {p + ' ms':>10} | {'ratio':>5}" for p in precisions))
    for v in variants:
        cells = [f" | {med[p][v]:10.2f} | " + (f"{ratio[p][v]:5.3f}" if v in ratio[p] else " " * 5) for p in precisions]
        print(f"{v:>13}" + "".join(cells))
    for p in precisions:
        for v in variants:
            print(f"rounds {p:>7} {v:>13}: {', '.join(f'{t:.2f}' for t in times[p][v])} ms/step")
        if "mwms" in variants and "ddp" in variants:
            print(f"throughput mwms / ddp, {p}: {med[p]['ddp'] / med[p]['mwms']:.3f}")
        if "mirrored2" in variants and "ddp2" in variants:
            print(f"throughput mirrored2 / ddp2 (2 replicas on one card), {p}: "
                  f"{med[p]['ddp2'] / med[p]['mirrored2']:.3f}")
        print(f"warm-up s ({args.warmup} steps, compilation included), {p}: "
              + ", ".join(f"{v} {statistics.median(w):.1f}" for v, w in warmups[p].items()))
        if "hand-compiled" in variants and "one-function" in variants:
            print(f"td.function / hand-compiled, {p}: speed {med[p]['hand-compiled'] / med[p]['one-function']:.3f} "
                  f"(above 1: td.function faster), warm-up ratio "
                  f"{statistics.median(warmups[p]['one-function']) / statistics.median(warmups[p]['hand-compiled']):.2f}")
        if any(g is not None for g in peak_gib[p].values()):
            print(f"peak GPU memory (GiB, last round, per process), {p}: "
                  + ", ".join(f"{v} {g:.2f}" for v, g in peak_gib[p].items() if g is not None))
    if loss_scales:
        print("fp16 loss scale after warmup -> after the timed steps (last round): "
              + ", ".join(f"{v} {s[0]:g} -> {s[1]:g}" for v, s in loss_scales.items()))
    print(RESULT + json.dumps({
        "device": name, "global_batch": GLOBAL_BATCH, "steps": args.steps, "warmup": args.warmup,
        "rounds": args.rounds, "precisions": precisions, "variants": variants,
        "ms_per_step": med, "ratio_hand_over_variant": ratio, "rounds_ms_per_step": times,
        "fp16_loss_scale": loss_scales, "peak_memory_gib": peak_gib, "warmup_s": warmups,
    }))


if __name__ == "__main__":
    main()
