"""(g) What authenticating the parameter-server transport costs (issue 32, docs/security.md).

Three measurements:

1. **Per message**: HMAC-SHA256 over message bodies of 1 KiB to 4 MiB (what every message
   of ``ps/secure_channel.py`` pays, on each side), next to cloudpickle of a tensor of the
   same size (what every message paid before too).
2. **Per call**: the round trip of an empty call over an authenticated channel on loopback
   (handshake once, then a MAC on the request and on the reply).
3. **Per scheduled function / step**: a parameter-server job (``create_in_process_cluster``,
   one worker, one ps; a 4→64→1 MLP, SGD, batch 32; 200 scheduled steps, one per function)
   in this tree, and, with ``--baseline DIR`` (a checkout of the commit before the transport
   change, e.g. ``git archive 4bb8b33 | tar -x -C /tmp/td-old``), the same job there:
   ``torch.distributed.rpc`` over TensorPipe, unauthenticated.

Run: ``python benchmarks/bench_ps_auth.py [--baseline /tmp/td-old] [--steps 200]``.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

JOB = r"""
import json, sys, time, torch, torch.nn.functional as F
from torch import nn
import torch_distribute as td

steps = int(sys.argv[1])
resolver = td.ps.create_in_process_cluster(num_workers=1, num_ps=1)
strategy = td.ParameterServerStrategy(resolver, startup_timeout=300)
coordinator = td.coordinator.ClusterCoordinator(strategy)
torch.manual_seed(0)
with strategy.scope():
    model = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

def dataset_fn(ctx):
    g = torch.Generator().manual_seed(ctx.input_pipeline_id)
    while True:
        x = torch.randn(32, 4, generator=g)
        yield x, x.sum(1, keepdim=True)

iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

def step(batches):
    x, y = next(batches)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()

def noop():
    return 0

for _ in range(20):  # warm-up: connections, references fetched once
    coordinator.schedule(step, args=(iterator,))
coordinator.join()
started = time.perf_counter()
for _ in range(steps):
    coordinator.schedule(noop)
coordinator.join()
per_function = (time.perf_counter() - started) / steps
started = time.perf_counter()
for _ in range(steps):
    coordinator.schedule(step, args=(iterator,))
coordinator.join()
per_step = (time.perf_counter() - started) / steps
print("BENCH " + json.dumps({"per_function_ms": per_function * 1e3, "per_step_ms": per_step * 1e3}), flush=True)
"""


def per_message(repeats: int = 50) -> list[dict[str, float]]:
    import cloudpickle
    import torch

    key = os.urandom(32)
    rows = []
    for size in (1 << 10, 64 << 10, 1 << 20, 4 << 20):
        body = os.urandom(size)
        tensor = torch.zeros(size // 4)
        mac = min(_time(lambda body=body: hmac.new(key, body, hashlib.sha256).digest(), repeats))
        pickled = min(_time(lambda tensor=tensor: cloudpickle.dumps(tensor), repeats))
        rows.append({"bytes": size, "hmac_us": mac * 1e6, "cloudpickle_us": pickled * 1e6})
    return rows


def per_call(calls: int = 2000) -> float:
    from torch_distribute.ps.secure_channel import ChannelClient, ChannelServer

    secret = os.urandom(32)
    server = ChannelServer(("127.0.0.1", 0), secret, {"nothing": lambda: None}, name="bench")
    client = ChannelClient(server.address, secret, name="bench-client")
    try:
        for _ in range(100):
            client.call("nothing", timeout=30)
        started = time.perf_counter()
        for _ in range(calls):
            client.call("nothing", timeout=30)
        return (time.perf_counter() - started) / calls
    finally:
        client.close()
        server.close()


def _time(function, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return times


def job(tree: str, steps: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    env.pop("TD_JOB_SECRET", None)
    done = subprocess.run([sys.executable, "-c", JOB, str(steps)], env=env, cwd=tree, capture_output=True,
                          text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("BENCH ")]
    if not lines:
        raise RuntimeError(f"the job in {tree} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[0][len("BENCH "):])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", default=None, help="a tree with the TensorPipe transport")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    sys.path.insert(0, REPO)
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs")
    for row in per_message():
        print(f"message {row['bytes']:>8} B: HMAC-SHA256 {row['hmac_us']:8.1f} us, "
              f"cloudpickle {row['cloudpickle_us']:8.1f} us")
    print(f"authenticated empty call, round trip: {per_call() * 1e6:.0f} us")
    results = {"secure channel (this tree)": job(REPO, args.steps)}
    if args.baseline:
        results["TensorPipe (baseline)"] = job(args.baseline, args.steps)
    for name, row in results.items():
        print(f"{name}: {row['per_function_ms']:.2f} ms per scheduled function, "
              f"{row['per_step_ms']:.2f} ms per training step")
    if args.baseline:
        new, old = results["secure channel (this tree)"], results["TensorPipe (baseline)"]
        print(f"ratio (secure / TensorPipe): function {new['per_function_ms'] / old['per_function_ms']:.2f}, "
              f"step {new['per_step_ms'] / old['per_step_ms']:.2f}")


if __name__ == "__main__":
    main()
