"""GPU: our strategies on one CUDA device vs the hand-written loop and vs DDP (NCCL, 1 rank).

A small ResNet-style CNN on synthetic 3x32x32 images, Adam, global batch 256, bfloat16
autocast optional. Each variant runs in its own process, several times, alternating, and
reports milliseconds per step (CUDA-synchronised); the table gives throughput ratios.

* ``hand``: the plain PyTorch loop on ``cuda:0``.
* ``one``: ``td.OneDeviceStrategy("cuda:0")``, ``strategy.run`` over a distributed dataset.
* ``central``: ``td.CentralStorageStrategy(["cuda:0"], parameter_device="cpu")``: parameters
  and Adam state on the host, compute on the GPU (gradients to the host, values back).
* ``mwms``: ``td.MultiWorkerMirroredStrategy`` with one worker on ``cuda:0``, started by
  ``torch_distribute.launch``. With one worker nothing crosses processes (no process group
  is made), so this measures the strategy's own cost on the GPU, not NCCL.
* ``ddp``: ``DistributedDataParallel`` with one NCCL rank on ``cuda:0`` (its reducer still
  copies every gradient into a bucket and all-reduces it over the one rank).

Every variant moves its host batches to the GPU inside the timed loop.

Run on a GPU machine: ``python benchmarks/bench_gpu.py [--steps 50 --rounds 3 --bf16]``.
"""

from __future__ import annotations

import argparse
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


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, bf16: bool) -> torch.Tensor:
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(x)
    return F.cross_entropy(logits.float(), y, reduction="none")


def run_variant(variant: str, steps: int, warmup: int, bf16: bool, device_name: str) -> float:
    """Seconds per step of one variant in this process."""
    batches = make_batches(warmup + steps)
    on_gpu = device_name.startswith("cuda")
    if variant in ("hand", "ddp"):
        device = torch.device(device_name)
        model = make_model().to(device)
        if variant == "ddp":
            import torch.distributed as dist

            dist.init_process_group("nccl" if on_gpu else "gloo", rank=0, world_size=1)
            model = nn.parallel.DistributedDataParallel(model, device_ids=[0] if on_gpu else None)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)

        def runner(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
            x, y = (t.to(device, non_blocking=True) for t in batch)
            loss = loss_of(model, x, y, bf16).sum() / GLOBAL_BATCH
            loss.backward()
            opt.step()
            opt.zero_grad()

        data = batches
    else:
        import torch_distribute as td

        if variant == "one":
            strategy = td.OneDeviceStrategy(device_name)
        elif variant == "central":
            # On the CPU (a check of this script), compute on a second logical CPU device.
            compute = device_name if on_gpu else "cpu:1"
            strategy = td.CentralStorageStrategy([compute], parameter_device="cpu:0")
        else:
            strategy = td.MultiWorkerMirroredStrategy(devices=[device_name])
        with strategy.scope():
            model = make_model()
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)

        def replica_step(x: torch.Tensor, y: torch.Tensor) -> None:
            loss = td.compute_average_loss(loss_of(model, x, y, bf16), global_batch_size=GLOBAL_BATCH)
            loss.backward()
            opt.step()
            opt.zero_grad()

        def runner(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
            strategy.run(replica_step, args=batch)

        data = strategy.experimental_distribute_dataset(batches)
    # Every variant moves its host batches to the device inside the timed loop.
    batch_iterator = iter(data)
    synchronize = torch.cuda.synchronize if on_gpu else (lambda: None)
    for _ in range(warmup):
        runner(next(batch_iterator))
    synchronize()
    started = time.perf_counter()
    for batch in batch_iterator:
        runner(batch)
    synchronize()
    return (time.perf_counter() - started) / steps


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(variant: str, args: argparse.Namespace) -> float:
    child = [HERE, "--child", variant, "--steps", str(args.steps), "--warmup", str(args.warmup),
             "--device", args.device]
    if args.bf16:
        child.append("--bf16")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if variant == "mwms":
        cmd = [sys.executable, "-m", "torch_distribute.launch", "--nproc", "1", *child]
    else:
        cmd = [sys.executable, *child]
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    for line in out.stdout.splitlines():
        if RESULT in line:
            return json.loads(line.split(RESULT, 1)[1])["s_per_step"]
    raise RuntimeError(f"{variant} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--variants", default="hand,one,central,mwms,ddp")
    parser.add_argument("--device", default="cuda:0", help="cpu only checks that the script runs")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(RESULT + json.dumps({"s_per_step": run_variant(args.child, args.steps, args.warmup, args.bf16, args.device)}))
        return
    variants = args.variants.split(",")
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for variant in variants:
            times[variant].append(spawn(variant, args))
    med = {v: statistics.median(t) for v, t in times.items()}
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "CPU"
    print(f"# {name}, global batch {GLOBAL_BATCH}, "
          f"{'bf16 autocast' if args.bf16 else 'float32'}, {args.steps} steps x {args.rounds} rounds")
    for v in variants:
        print(f"{v:>8}: {med[v] * 1e3:7.2f} ms/step  (rounds: {', '.join(f'{t * 1e3:.2f}' for t in times[v])})")
    if "hand" in med:
        for v in variants:
            if v != "hand":
                print(f"throughput {v} / hand: {med['hand'] / med[v]:.3f}")
    if "mwms" in med and "ddp" in med:
        print(f"throughput mwms / ddp: {med['ddp'] / med['mwms']:.3f}")
    print(RESULT + json.dumps({"bf16": args.bf16, "ms_per_step": {v: m * 1e3 for v, m in med.items()}}))


if __name__ == "__main__":
    main()
