"""Where a compiled step of the seed CNN loses to eager on a CPU (a diagnostic, not part of ``make bench``).

Trains the tutorial CNN of ``bench_compile.py`` with Adam in one process, eager and under
``torch.compile(model)``, times both, then profiles ``--profile-steps`` steps of each with
``torch.profiler`` and inductor's ``cpp.enable_kernel_profile`` (each generated C++ kernel shows
up under its own name) and prints the ops that cost the most. On the 2-core test machine the
convolutions are the same oneDNN calls in both; the difference is in the kernels inductor
generates for max-pool and the ReLUs (see ``docs/compiled-steps.md``, "When it pays off").

Run: ``python benchmarks/profile_compile_cpu.py [--steps 40 --profile-steps 10 --rows 12]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch.profiler import profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import make_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--rows", type=int, default=12)
    args = parser.parse_args()
    inductor_config.cpp.enable_kernel_profile = True
    x, y = torch.randn(args.batch, 1, 28, 28), torch.randint(0, 10, (args.batch,))
    for name in ("eager", "compiled"):
        model = make_model()
        forward = torch.compile(model) if name == "compiled" else model
        step = _trainer(forward, torch.optim.Adam(model.parameters()), x, y)
        for _ in range(5):  # compiles, and warms the allocator
            step()
        started = time.perf_counter()
        for _ in range(args.steps):
            step()
        print(f"{name}: {(time.perf_counter() - started) / args.steps * 1e3:.1f} ms/step")
        with profile() as prof:
            for _ in range(args.profile_steps):
                step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


def _trainer(forward: Callable[[torch.Tensor], torch.Tensor], optimizer: torch.optim.Optimizer,
             x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        F.cross_entropy(forward(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step

if __name__ == "__main__":
    main()
