"""GPU: ``td.FullyShardedStrategy`` with one NCCL worker vs hand-written FSDP2 on the same card.

The GPT of ``examples/gpt_fully_sharded.py`` at the size of ``bench_fully_sharded.py`` (its
model, data and optimizer helpers are reused), scaled up with ``--width``/``--layers`` so the
GPU has work to do. One worker process per variant, NCCL with world size 1, run ``--rounds``
times alternating; medians of ms/step, the ratio hand-written / ours (above 1: ours faster),
the peak GPU memory of each, and the largest parameter difference after the timed steps (the
same collectives and arithmetic: bitwise equal is expected).

* ``ours``: ``td.FullyShardedStrategy(device="cuda:0")`` from torchrun's variables (one worker),
  model and optimizer made in its scope, ``strategy.run`` of the step with
  ``td.compute_average_loss``, then ``strategy.reduce("sum", ...)`` of the loss.
* ``FSDP2``: ``dist.init_process_group("nccl")``, ``fully_shard`` of every block then the root
  with ``reshard_after_forward=True`` (as ours), gradients summed, ``sum / global batch``, and
  one ``all_reduce`` of the detached loss a step (the same logging collective).

    python benchmarks/bench_fully_sharded_gpu.py                 # defaults, about 2 minutes
    python benchmarks/bench_fully_sharded_gpu.py --device cpu --steps 2 --warmup 1 --rounds 1

``--profile``: the last round's processes each profile ``PROFILE_STEPS`` more steps (after the
parameters are saved) with ``torch.profiler``, and the report shows, for each, the ops that
cost the most device time, those that cost the most host time, and per step: the host syncs
(``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``item``), the copies and the NCCL
kernels, with the step's wall time against its device-busy time (what the host adds).

``--device cpu`` only checks that the script runs (gloo). The last line printed is
``FSDPGPUBENCH {json}``.
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
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # the repository root: ``examples`` is a package

RESULT = "FSDPGPUBENCH "
PROFILE_RESULT = "FSDPGPUPROFILE "
PROFILE_STEPS = 5
PROFILE_ROWS = 12
VARIANTS = ("ours", "FSDP2")
GLOBAL_BATCH = 32
SEQ_LEN = 128
LR = 1e-3
SEED = 1234


def _batches(args: argparse.Namespace) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    from examples.gpt_fully_sharded import CharData, load_text, make_batches

    data = CharData(load_text())
    return data, make_batches(data.train, 8, GLOBAL_BATCH, SEQ_LEN, SEED)


def _model(vocab_size: int, args: argparse.Namespace) -> torch.nn.Module:
    from examples.gpt_fully_sharded import make_model

    torch.manual_seed(SEED)
    shape = argparse.Namespace(seq_len=SEQ_LEN, width=args.width, layers=args.layers, heads=args.heads)
    return make_model(vocab_size, shape)


def _ours(args: argparse.Namespace, device: torch.device):
    import torch_distribute as td
    from examples.gpt_fully_sharded import per_window_loss

    strategy = td.FullyShardedStrategy(device=str(device))
    data, batches = _batches(args)
    with strategy.scope():
        model = _model(data.vocab_size, args)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)

    def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        loss = td.compute_average_loss(per_window_loss(model, x, y), global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def step(batch: Any) -> torch.Tensor:
        return strategy.reduce("sum", strategy.run(train_step, args=(batch,)), axis=None)

    return step, strategy.experimental_distribute_dataset(batches), model


def _hand(args: argparse.Namespace, device: torch.device):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from examples.gpt_fully_sharded import per_window_loss

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    data, batches = _batches(args)
    with torch.device(device):
        model = _model(data.vocab_size, args)
    mesh = init_device_mesh(device.type, (1,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = (t.to(device, non_blocking=True) for t in batch)
        loss = per_window_loss(model, x, y).sum() / GLOBAL_BATCH
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        return logged

    return step, batches, model


def run_child(variant: str, args: argparse.Namespace, later: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(device)
    step, batches, model = (_ours if variant == "ours" else _hand)(args, device)
    synchronize = torch.cuda.synchronize if on_gpu else (lambda: None)
    batch_list = list(batches)

    def batch(i: int) -> Any:
        return batch_list[i % len(batch_list)]

    for i in range(args.warmup):
        step(batch(i))
    synchronize()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    for i in range(args.steps):
        loss = step(batch(args.warmup + i))
    synchronize()
    seconds = (time.perf_counter() - started) / args.steps
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu()
              for n, p in model.named_parameters()}
    path = os.path.join(args.params_dir, f"{variant}.pt")
    torch.save(params, path)
    if args.profile:  # after the timings are out: a profiler failure loses only the profile
        later["profile"] = lambda: _profile(step, batch, synchronize, on_gpu)
    return {"ms_per_step": seconds * 1e3, "last_loss": float(loss),
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else None,
            "num_params": sum(p.numel() for p in params.values())}


def _profile(step: Any, batch: Any, synchronize: Any, on_gpu: bool) -> dict[str, Any]:
    """``PROFILE_STEPS`` more steps under ``torch.profiler``: device-time and host-time tables,
    and per step the syncs, copies and NCCL kernels, and wall vs device-busy milliseconds."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    synchronize()
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        for i in range(PROFILE_STEPS):
            step(batch(i))
        synchronize()
    wall_ms = (time.perf_counter() - started) * 1e3 / PROFILE_STEPS
    averages = prof.key_averages()
    calls: dict[str, int] = {}
    for event in prof.events():
        calls[event.name] = calls.get(event.name, 0) + 1
    nccl = sum(count for name, count in calls.items() if "nccl" in name.lower() and "Kernel" in name)
    device_ms = (sum(e.self_device_time_total for e in averages) / 1e3 / PROFILE_STEPS) if on_gpu else None
    return {
        "device_table": averages.table(sort_by="self_cuda_time_total", row_limit=PROFILE_ROWS) if on_gpu else "",
        "host_table": averages.table(sort_by="self_cpu_time_total", row_limit=PROFILE_ROWS),
        "per_step": {**{name: calls.get(name, 0) / PROFILE_STEPS for name in (
            "cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::_local_scalar_dense", "cudaMemcpyAsync",
            "aten::copy_")}, "NCCL kernels": nccl / PROFILE_STEPS},
        "wall_ms_per_step": wall_ms, "device_busy_ms_per_step": device_ms,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(variant: str, args: argparse.Namespace, profile: bool = False) -> dict[str, Any]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.pop("TF_CONFIG", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--device", args.device,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--width", str(args.width),
           "--layers", str(args.layers), "--heads", str(args.heads), "--params-dir", args.params_dir]
    if profile:
        cmd.append("--profile")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    found: dict[str, Any] | None = None
    for line in out.stdout.splitlines():
        if line.startswith(RESULT):
            found = json.loads(line[len(RESULT):])
        elif line.startswith(PROFILE_RESULT) and found is not None:
            found["profile"] = json.loads(line[len(PROFILE_RESULT):])
    if found is not None:
        if profile and "profile" not in found:
            found["profile"] = {"device_table": "", "host_table": f"(the profile failed: exit status "
                                f"{out.returncode})\n{out.stderr[-1500:]}", "per_step": {},
                                "wall_ms_per_step": float("nan"), "device_busy_ms_per_step": None}
        return found
    raise RuntimeError(f"{variant} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0", help="cpu only checks that the script runs")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--child-timeout", type=int, default=300)
    parser.add_argument("--profile", action="store_true",
                        help=f"profile {PROFILE_STEPS} more steps in the last round's processes")
    parser.add_argument("--params-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        later: dict[str, Any] = {}
        print(RESULT + json.dumps(run_child(args.child, args, later)), flush=True)
        if "profile" in later:
            print(PROFILE_RESULT + json.dumps(later["profile"]()), flush=True)
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench_fully_sharded_gpu.py needs a CUDA GPU (--device cpu only checks the script).")
    import tempfile

    with tempfile.TemporaryDirectory() as params_dir:
        args.params_dir = params_dir
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
        for round_index in range(args.rounds):
            for variant in VARIANTS:
                runs[variant].append(spawn(variant, args, profile=args.profile and round_index == args.rounds - 1))
                print(f"{variant}: {runs[variant][-1]['ms_per_step']:.2f} ms/step", file=sys.stderr, flush=True)
        ours, hand = (torch.load(os.path.join(params_dir, f"{v}.pt")) for v in VARIANTS)
    diff = max(float((ours[n] - hand[n]).abs().max()) for n in ours)
    med = {v: statistics.median(r["ms_per_step"] for r in runs[v]) for v in VARIANTS}
    peak = {v: runs[v][-1]["peak_memory_gib"] for v in VARIANTS}
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "CPU (a check of the script)"
    print(f"# {name}, torch {torch.__version__}; GPT {runs['ours'][0]['num_params']:,} parameters, "
          f"global batch {GLOBAL_BATCH} x {SEQ_LEN}; one worker; {args.steps} steps x {args.rounds} rounds, medians")
    for v in VARIANTS:
        memory = f", peak GPU memory {peak[v]:.2f} GiB" if peak[v] is not None else ""
        print(f"{v:>6}: {med[v]:8.2f} ms/step{memory}")
    print(f"throughput ours / hand-written FSDP2: {med['FSDP2'] / med['ours']:.3f}; "
          f"parameters after the last round, max abs difference: {diff:.3g}")
    for v in VARIANTS:
        profiled = runs[v][-1].get("profile")
        if profiled:
            busy = profiled["device_busy_ms_per_step"]
            print(f"--- profile {v}: {profiled['wall_ms_per_step']:.2f} ms/step wall"
                  + (f", device busy {busy:.2f} ms/step" if busy is not None else "")
                  + "; per step " + ", ".join(f"{k} {c:g}" for k, c in profiled["per_step"].items()))
            print(profiled["device_table"] + profiled["host_table"])
    print(RESULT + json.dumps({"device": name, "torch": torch.__version__, "ms_per_step": med,
                               "ratio_ours_over_fsdp2": med["FSDP2"] / med["ours"],
                               "peak_memory_gib": peak, "max_abs_param_diff": diff}))


if __name__ == "__main__":
    main()
