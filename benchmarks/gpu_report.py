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

Then the checks of issue 45 (compiled steps at least as fast as hand-compiled code, the
CycleGAN epoch in 40 s), the group ``--only issue45`` in this order:

8. ``cyclegan-compiled``: fp32, ``td.function`` vs the hand-compiled networks (ms/step and the
   warm-up ratio), with dynamo's graph breaks and a ``torch.profiler`` table of each.
9. ``cyclegan-best``: the library's best settings (bf16 autocast, channels-last, fused Adam,
   CUDA graphs): ``td.function`` vs the hand-compiled networks, the projected horse2zebra
   epoch, and the numerics over 200 steps against a float32 eager run from the same weights.
10. ``fully-sharded-profile``: ``fully-sharded`` with a profile of both loops.
11. ``resnet-compiled``: ``bench_gpu.py``'s ResNet, ``td.function`` vs ``torch.compile`` by
    hand, float32 and bf16.
12. ``cyclegan-best-batch8``: ``cyclegan-best``'s settings at batch 8 per replica.

Every benchmark reports peak GPU memory and ratios measured in the same run. The report
(``benchmarks/gpu-report-YYYY-MM-DD.md``, and a copy in ``$OUT`` where that is set) is
rewritten after every step: device, driver, CUDA, torch, then each step's command, status,
seconds and printed tables.

Which Python: the first of this interpreter and ``python3`` whose torch sees a GPU (the GPU
machines' images carry a CUDA build); where none does but ``nvidia-smi`` finds a GPU, it makes
``.venv-gpu`` with PyPI's default (CUDA) torch and runs there. The package itself is used
from this checkout (``PYTHONPATH``), so nothing is built.

Time: every step has an estimate (``estimate_s``: seconds on one H100 with cold caches, as
measured on 2026-11-26 where it was, else reckoned from the parts that were) and a hard limit
of at most 9 minutes; the whole runs within ``--budget`` seconds (at most 40 minutes). A step
starts only if its estimate fits in what is left of the budget, and runs under its limit or
what is left, whichever is less; the others are reported as skipped. ``--only`` picks steps
or groups (to spread them over several machine leases: each call writes its own report;
``--suffix`` keeps them apart). A lease starts in about 30 s to 2 minutes. Where a session
has 15 minutes of device time in calls of at most 10, the issue-45 checks go in two calls::

    make gpu-report ARGS="--only cyclegan-compiled,cyclegan-best,fully-sharded-profile --budget 560 --suffix a"
    make gpu-report ARGS="--only resnet-compiled --budget 230 --suffix b"

(as run on 2026-11-27: 536 s and 199 s, with about 30 s of machine start before the first;
the second call must follow at once, within the machine's 30 s of idle, or it starts a new
one. ``cyclegan-best-batch8`` needs a lease of its own.) The steps of a call share the
machine's inductor cache, so ``cyclegan-best``'s numerics run reuses its own compiled step.
Without a GPU, or with ``--dry-run``, it prints the plan (each step's estimate and limit, and
which would be skipped under the budget) and exits 0.

    make gpu-report                                      # everything (40 minutes)
    python benchmarks/gpu_report.py --dry-run --only issue45 --budget 840
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
    limit_s: int  # the hard limit
    argv: tuple[str, ...]  # after the interpreter
    what: str
    estimate_s: int  # on one H100, cold caches: what the plan counts


STEPS = (
    # no:logging: a failing compiled test's captured log is hundreds of torch.__trace DEBUG lines.
    Step("gpu-tests", 360,
         ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:logging", "tests/test_gpu.py"),
         "tests/test_gpu.py", 120),  # H100 81 s, H200 130 s
    Step("precision", 360, ("benchmarks/bench_gpu.py", "--precision", "all", "--rounds", "2", "--steps", "40"),
         "one GPU: every strategy vs hand-written and DDP, fp32 / bf16 / fp16", 300),  # H200 299 s
    Step("cyclegan", 480, ("benchmarks/bench_cyclegan_gpu.py", "--rounds", "1",
                           "--variants", "hand-eager,hand-compiled,one-eager,one-function"),
         "CycleGAN 256x256 batch 1, fp32: eager, compiled, td.function (epoch seconds)", 270),  # H100 261 s
    Step("cyclegan-bf16", 300, ("benchmarks/bench_cyclegan_gpu.py", "--rounds", "1", "--bf16",
                                "--variants", "hand-eager,one-eager,one-function"),
         "CycleGAN 256x256 batch 1, bf16 autocast", 190),  # H100 187 s
    Step("logical-gpus", 240, ("benchmarks/bench_gpu.py", "--variants", "mirrored2,ddp2", "--precision", "float32",
                               "--rounds", "2", "--steps", "40"),
         "MirroredStrategy on 2 logical GPUs of one card vs DDP with 2 processes on it", 60),  # 51-59 s
    Step("fully-sharded", 240, ("benchmarks/bench_fully_sharded_gpu.py",),
         "FullyShardedStrategy, one NCCL worker, vs hand-written FSDP2", 80),  # H200 75 s
    Step("cyclegan-batch8", 420, ("benchmarks/bench_cyclegan_gpu.py", "--rounds", "1", "--batch-size", "8",
                                  "--variants", "hand-eager,one-eager,one-function"),
         "CycleGAN 256x256 batch 8 per replica", 250),
    # Issue 45. Estimates from the 2026-11-26 H100 runs: a CycleGAN process ~10 s to start, the
    # hand-compiled networks' warm-up 39 s, td.function's 149 s (fp32) / 138 s (bf16), eager
    # fp32 107 ms/step; the profile adds ~10 s per process. Measured 2026-11-27 with a graph per
    # network (H100, cold caches): cyclegan-compiled 194 s, cyclegan-best 248 s,
    # fully-sharded-profile 73 s; resnet-compiled 178 s (H200). The next lease: these four in two
    # calls of 540 and 200 s (plus ~1 min start each) leave nothing for cyclegan-best-batch8.
    Step("cyclegan-compiled", 420, ("benchmarks/bench_cyclegan_gpu.py", "--rounds", "1", "--profile",
                                    "--variants", "hand-compiled,one-function"),
         "CycleGAN 256x256 batch 1, fp32: td.function (a graph per network) vs hand-compiled networks, "
         "warm-up, graph breaks, profile", 200),
    Step("cyclegan-best", 480, ("benchmarks/bench_cyclegan_gpu.py", "--rounds", "1", "--bf16", "--channels-last",
                                "--fused-adam", "--warmup", "10", "--steps", "190", "--numerics-reference",
                                "--variants", "hand-compiled,one-function"),
         "CycleGAN 256x256 batch 1, best settings (bf16, channels-last, fused Adam, CUDA graphs): epoch "
         "seconds, td.function vs hand-compiled, numerics over 200 steps vs fp32 eager", 260),
    Step("fully-sharded-profile", 240, ("benchmarks/bench_fully_sharded_gpu.py", "--rounds", "2", "--profile"),
         "FullyShardedStrategy vs hand-written FSDP2, one NCCL worker, with a profile of each", 80),
    Step("resnet-compiled", 360, ("benchmarks/bench_gpu.py", "--precision", "float32,bf16", "--rounds", "1",
                                  "--steps", "40", "--variants", "hand,hand-compiled,one,one-function"),
         "bench_gpu's ResNet: td.function vs torch.compile by hand, fp32 and bf16, warm-up", 180),
    Step("cyclegan-best-batch8", 420, ("benchmarks/bench_cyclegan_gpu.py", "--rounds", "1", "--bf16",
                                       "--channels-last", "--fused-adam", "--batch-size", "8",
                                       "--variants", "hand-compiled,one-function"),
         "CycleGAN 256x256 batch 8 per replica, best settings", 230),
)
#: Named sets of steps for ``--only``, in the order they run.
GROUPS = {"issue45": ("cyclegan-compiled", "cyclegan-best", "fully-sharded-profile", "resnet-compiled",
                      "cyclegan-best-batch8")}


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


def fits(steps: list[Step], budget_s: int) -> list[bool]:
    """Which steps the plan starts, each if its estimate fits in what the ones before it (at
    their estimates) leave of ``budget_s``; a step that does not fit is skipped and costs
    nothing, so a later, shorter one may still run."""
    left, chosen = budget_s, []
    for step in steps:
        chosen.append(step.estimate_s <= left)
        if chosen[-1]:
            left -= step.estimate_s
    return chosen


def plan(steps: list[Step], budget_s: int) -> str:
    rows = [f"{'step':<22} {'estimate s':>10} {'limit s':>7}  command"]
    for step, runs in zip(steps, fits(steps, budget_s), strict=True):
        rows.append(f"{step.name:<22} {step.estimate_s:>10} {step.limit_s:>7}  python {' '.join(step.argv)}"
                    + ("" if runs else "  [skipped: does not fit the budget]"))
    planned = sum(s.estimate_s for s, runs in zip(steps, fits(steps, budget_s), strict=True) if runs)
    rows.append(f"{'total':<22} {planned:>10} {'':>7}  (estimates of the steps that fit; budget {budget_s} s: "
                f"a step starts only if its estimate fits in what is left)")
    return "\n".join(rows)


def select(only: str) -> list[Step]:
    """The steps ``--only`` names (steps or groups, comma-separated), in the order given;
    every step when empty. ``ValueError`` names what is unknown."""
    names: list[str] = []
    for name in (n.strip() for n in only.split(",") if n.strip()):
        names.extend(GROUPS.get(name, (name,)))
    by_name = {s.name: s for s in STEPS}
    unknown = sorted({n for n in names if n not in by_name})
    if unknown:
        raise ValueError(f"unknown steps {unknown}: use some of {', '.join(by_name)} or the groups "
                         f"{', '.join(GROUPS)}")
    return [by_name[n] for n in dict.fromkeys(names)] if names else list(STEPS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--only", default="",
                        help=f"comma-separated steps, of {', '.join(s.name for s in STEPS)}, or groups: "
                             f"{', '.join(GROUPS)}")
    parser.add_argument("--budget", type=int, default=TOTAL_LIMIT_S, help="seconds for the whole (max 2400)")
    parser.add_argument("--suffix", default="", help="added to the report's file name")
    args = parser.parse_args(argv)
    try:
        steps = select(args.only)
    except ValueError as error:
        parser.error(str(error))
    if args.budget < 1:
        parser.error("--budget must be a positive number of seconds")
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
        if step.estimate_s > left:
            outcomes.append(Outcome(step, f"skipped (estimated {step.estimate_s} s, {left} s left of the budget)"))
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
