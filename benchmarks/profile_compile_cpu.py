"""Where a compiled step of the seed CNN loses to eager on a CPU (a diagnostic, not part of ``make bench``).

Runs ``bench_compile.py``'s ``hand-eager`` and ``hand-compiled`` steps (the tutorial CNN, Adam,
the same global batches; ``torch.compile(model)`` in the second) in one process, times both,
then profiles ``--profile-steps`` steps of each with ``torch.profiler`` and inductor's
``cpp.enable_kernel_profile`` (each generated C++ kernel shows up under its own name) and
prints the ops that cost the most. On the 2-core test machine the convolutions are the same
oneDNN calls in both; the difference is in the kernels inductor generates for max-pool and
the ReLUs (see ``docs/compiled-steps.md``, "When it pays off").

Run: ``python benchmarks/profile_compile_cpu.py [--batch 64 --steps 40 --profile-steps 10 --rows 12]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch._inductor.config as inductor_config
from torch.profiler import profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_compile import hand_compiled_trainer  # noqa: E402
from common import handwritten_trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--rows", type=int, default=12)
    args = parser.parse_args()
    inductor_config.cpp.enable_kernel_profile = True
    trainers = {"eager": lambda: handwritten_trainer(torch.float32, args.batch),
                "compiled": lambda: hand_compiled_trainer(torch.float32, args.batch, whole_step=False)}
    for name, make in trainers.items():
        trainer = make()
        trainer.run_steps(5)  # compiles, and warms the allocator
        started = time.perf_counter()
        trainer.run_steps(args.steps)
        print(f"{name}: {(time.perf_counter() - started) / args.steps * 1e3:.1f} ms/step")
        with profile() as prof:
            trainer.run_steps(args.profile_steps)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
