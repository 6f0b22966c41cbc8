"""One worker of the sharded-build memory job; prints one ``BUILDRESULT {json}`` line.

    python build_memory_job.py [--timeout S]

A 268M-parameter stack of ``nn.Linear`` (1 GiB of float32) built in
``FullyShardedStrategy.scope()`` and sharded (an optimizer made there). Reports how much this
worker's peak resident memory (``VmHWM``) grew from just before the model was built, what it
holds, and how long the build took.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tp_model as M  # noqa: E402

import torch_distribute as td  # noqa: E402

WIDTH, DEPTH = 2048, 64  # 64 x (2048 x 2048 + 2048) float32 parameters: 1.0 GiB

parser = argparse.ArgumentParser()
parser.add_argument("--timeout", type=float, default=60)
args = parser.parse_args()
torch.set_num_threads(1)

strategy = td.FullyShardedStrategy(communication_options=td.CommunicationOptions(timeout_seconds=args.timeout))
before = M.vm_kib("VmRSS")
started = time.monotonic()
torch.manual_seed(0)
with strategy.scope():
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)))
    torch.optim.SGD(model.parameters(), lr=0.1)
seconds = time.monotonic() - started
params = list(model.parameters())
print("BUILDRESULT " + json.dumps({
    "rank": strategy.extended.worker_index,
    "peak_growth_bytes": (M.vm_kib("VmHWM") - before) * 1024,
    "whole_bytes": sum(p.numel() * p.element_size() for p in params),
    "local_bytes": sum(p.to_local().numel() * p.element_size() for p in params),
    "types": sorted({type(p).__name__ for p in params}),
    "seconds": round(seconds, 2),
}), flush=True)
