"""``make gpu-report``: every GPU figure in one command, written to one dated markdown report.

On a machine with an NVIDIA GPU it runs, in this order (the most important figures first, so
a run cut off by its machine's lease still leaves a report), each step as its own process
under its own time limit:

1. ``gpu-tests``: ``tests/test_gpu.py`` (CUDA replicas, NCCL, host parameters, bf16, fp16).
2. ``precision``: ``bench_gpu.py --precision all``: every strategy on one GPU vs the
   hand-written loop and DDP, in float32, bf16 and fp16 + GradScaler.
3. ``cyclegan``: the CycleGAN step at the tutorial's size (256x256, batch 1): eager fp32, the
   hand-compiled networks and ``td.function``, with the projected epoch of horse2zebra.
4. ``cyclegan-bf16``: the same under bfloat16 autocast.
5. ``logical-gpus``: ``MirroredStrategy`` over 2 logical GPUs of the card vs DDP with 2
   processes sharing it.
6. ``fully-sharded``: ``FullyShardedStrategy`` with one NCCL worker vs hand-written FSDP2.
7. ``cyclegan-batch8``: the CycleGAN step at batch 8 per replica.

Every benchmark reports peak GPU memory and ratios measured in the same run. The report
(``benchmarks/gpu-report-YYYY-MM-DD.md``, and a copy in ``$OUT`` where that is set) is
rewritten after every step: device, driver, CUDA, torch, then each step's command, status,
seconds and printed tables.

Which Python: the first of this interpreter and ``python3`` whose torch sees a GPU (the GPU
machines' images carry a CUDA build); where none does but ``nvidia-smi`` finds a GPU, it makes
``.venv-gpu`` with PyPI's default (CUDA) torch and runs there. The package itself is used
from this checkout (``PYTHONPATH``), so nothing is built.

Time: each step has a limit of at most 9 minutes and the whole at most 40; a step that would
not fit in what is left is reported as skipped. ``--only`` picks steps (to spread them over
several machine leases: each call writes its own report; ``--suffix`` keeps them apart).
Measured on an H200 (2026-11-26, cold caches): gpu-tests 130 s, precision 299 s, logical-gpus
59 s, fully-sharded 75 s; on an H100 (the same day): gpu-tests 81 s, cyclegan 261 s,
cyclegan-bf16 187 s, logical-gpus 51 s; a lease started in about 30 s. Where a session has 15
minutes of device time in calls of at most 10, split it, e.g. ``--only
gpu-tests,precision,logical-gpus --budget 545`` then ``--only fully-sharded,cyclegan
--suffix b --budget 300``.
Without a GPU, or with ``--dry-run``, it prints the plan with each step's limit and exits 0.

    make gpu-report                                      # everything
    python benchmarks/gpu_report.py --dry-run            # the plan
    python benchmarks/gpu_report.py --only gpu-tests,precision --budget 600
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_LIMIT_S = 540
TOTAL_LIMIT_S = 2400
JSON_PREFIXES = ("GPUBENCH ", "CYCLEGANBENCH ", "FSDPGPUBENCH ")


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    limit_s: int
    argv: tuple[str, ...]  # after the interpreter
    what: str


STEPS = (
    # no:logging: a failing compiled test's captured log is hundreds of torch.__trace DEBUG lines.
    Step("gpu-tests", 360,
         ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:logging", "tests/test_gpu.py"),
         "tests/test_gpu.py"),
    Step("precision", 360, ("benchmarks/bench_gpu.py", "--precision", "all", "--rounds", "2", "--steps", "40"),
         "one GPU: every strategy vs hand-written and DDP, fp32 / bf16 / fp16"),
    Step("cyclegan", 480, ("benchmarks/bench_cyclegan_gpu.py", "--rounds", "1",
                           "--variants", "hand-eager,hand-compiled,one-eager,one-function"),
         "CycleGAN 256x256 batch 1, fp32: eager, compiled, td.function (epoch seconds)"),
    Step("cyclegan-bf16", 300, ("benchmarks/bench_cyclegan_gpu.py", "--rounds", "1", "--bf16",
                                "--variants", "hand-eager,one-eager,one-function"),
         "CycleGAN 256x256 batch 1, bf16 autocast"),
    Step("logical-gpus", 240, ("benchmarks/bench_gpu.py", "--variants", "mirrored2,ddp2", "--precision", "float32",
                               "--rounds", "2", "--steps", "40"),
         "MirroredStrategy on 2 logical GPUs of one card vs DDP with 2 processes on it"),
    Step("fully-sharded", 240, ("benchmarks/bench_fully_sharded_gpu.py",),
         "FullyShardedStrategy, one NCCL worker, vs hand-written FSDP2"),
    Step("cyclegan-batch8", 420, ("benchmarks/bench_cyclegan_gpu.py", "--rounds", "1", "--batch-size", "8",
                                  "--variants", "hand-eager,one-eager,one-function"),
         "CycleGAN 256x256 batch 8 per replica"),
)


def _probe(python: str) -> bool:
    """Whether ``python``'s torch sees a CUDA device."""
    try:
        out = subprocess.run([python, "-c", "import torch; print(torch.cuda.is_available())"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip().endswith("True")


def gpu_present() -> bool:
    smi = shutil.which("nvidia-smi")
    return smi is not None and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


def find_python() -> str | None:
    """An interpreter whose torch sees the GPU, installing one into ``.venv-gpu`` if needed."""
    for candidate in (sys.executable, shutil.which("python3")):
        if candidate and _probe(candidate):
            return candidate
    if not gpu_present():
        return None
    venv = os.path.join(ROOT, ".venv-gpu")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    # PyPI's default torch wheel is the CUDA build.
    subprocess.run([python, "-m", "pip", "install", "-q", "torch>=2.4", "numpy", "cloudpickle",
                    "pytest", "pytest-timeout"], check=True)
    return python if _probe(python) else None


def _read(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def machine_lines(python: str) -> list[str]:
    smi = shutil.which("nvidia-smi") or "nvidia-smi"
    gpu = _read([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    torch_line = _read([python, "-c", "import torch; print(torch.__version__, 'CUDA', torch.version.cuda, "
                                      "'cuDNN', torch.backends.cudnn.version())"])
    return [f"- GPU, memory, driver: {gpu}", f"- torch: {torch_line}",
            f"- Python: {_read([python, '-c', 'import sys; print(sys.version.split()[0])'])}",
            f"- CPU cores: {os.cpu_count()}"]


@dataclasses.dataclass
class Outcome:
    step: Step
    status: str  # ok, failed (exit N), timed out, skipped (...)
    seconds: float = 0.0
    output: str = ""


def run_step(python: str, step: Step, limit_s: int) -> Outcome:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1")
    started = time.monotonic()
    try:
        out = subprocess.run([python, *step.argv], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=limit_s)
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return Outcome(step, f"timed out after {limit_s} s", time.monotonic() - started, text[-6000:])
    seconds = time.monotonic() - started
    # The JSON lines the benchmarks end with hold the same numbers as their tables.
    shown = "\n".join(line for line in out.stdout.splitlines() if not line.startswith(JSON_PREFIXES))
    if out.returncode != 0:
        shown += "\n--- stderr (end) ---\n" + out.stderr[-4000:]
        return Outcome(step, f"failed (exit {out.returncode})", seconds, shown)
    return Outcome(step, "ok", seconds, shown)


def render(date: str, machine: list[str], outcomes: list[Outcome], planned: list[Step]) -> str:
    lines = [f"# GPU report, {date}", "", "Written by `make gpu-report` (`benchmarks/gpu_report.py`). "
             "Ratios compare variants measured in this same run on this machine.", "", *machine, "",
             "| step | what | status | seconds |", "| --- | --- | --- | --- |"]
    done = {o.step.name: o for o in outcomes}
    for step in planned:
        o = done.get(step.name)
        lines.append(f"| {step.name} | {step.what} | {o.status if o else 'not reached'} | "
                     f"{f'{o.seconds:.0f}' if o else ''} |")
    for o in outcomes:
        lines += ["", f"## {o.step.name}", "", f"`python {' '.join(o.step.argv)}`: {o.status}, {o.seconds:.0f} s"]
        if o.output.strip():
            lines += ["", "```", o.output.strip(), "```"]
    return "\n".join(lines) + "\n"


def plan(steps: list[Step], budget_s: int) -> str:
    rows = [f"{'step':<16} {'limit s':>7}  command"]
    rows += [f"{s.name:<16} {s.limit_s:>7}  python {' '.join(s.argv)}" for s in steps]
    rows.append(f"{'total':<16} {sum(s.limit_s for s in steps):>7}  (budget {budget_s} s; "
                f"a step that does not fit in what is left is skipped)")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--only", default="", help=f"comma-separated steps, of {', '.join(s.name for s in STEPS)}")
    parser.add_argument("--budget", type=int, default=TOTAL_LIMIT_S, help="seconds for the whole (max 2400)")
    parser.add_argument("--suffix", default="", help="added to the report's file name")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - {s.name for s in STEPS})
    if unknown:
        parser.error(f"unknown steps {unknown}")
    steps = [s for s in STEPS if not names or s.name in names]
    assert all(s.limit_s <= STEP_LIMIT_S for s in steps), "every step fits in 9 minutes"
    budget = min(args.budget, TOTAL_LIMIT_S)
    print(plan(steps, budget), flush=True)
    if args.dry_run:
        return 0
    python = find_python()
    if python is None:
        print("gpu-report: no CUDA GPU here (nvidia-smi finds none and no torch sees one): "
              "the plan above is what it runs on a GPU machine.", flush=True)
        return 0
    date = datetime.date.today().isoformat()
    name = f"gpu-report-{date}{'-' + args.suffix if args.suffix else ''}.md"
    targets = [os.path.join(ROOT, "benchmarks", name)]
    if os.environ.get("OUT"):
        targets.append(os.path.join(os.environ["OUT"], name))
    machine = machine_lines(python)
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + budget
    for step in steps:
        left = int(deadline - time.monotonic())
        if left < min(step.limit_s, 60):
            outcomes.append(Outcome(step, f"skipped ({left} s left of the budget)"))
        else:
            print(f"gpu-report: {step.name} (limit {min(step.limit_s, left)} s)", flush=True)
            outcomes.append(run_step(python, step, min(step.limit_s, left)))
            print(f"gpu-report: {step.name}: {outcomes[-1].status} in {outcomes[-1].seconds:.0f} s", flush=True)
        text = render(date, machine, outcomes, steps)
        for target in targets:
            with open(target, "w") as f:
                f.write(text)
    print(f"gpu-report: wrote {', '.join(targets)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
