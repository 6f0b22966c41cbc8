"""Run every benchmark and summarise them in a Markdown table (``benchmarks/results.md``).

Compared (see each script's docstring):

* (a) ``bench_one_device.py``: the seed CNN step under ``OneDeviceStrategy`` vs the same
  hand-written PyTorch loop, global batch 64 (goal: ours / hand-written <= 1.01 in time).
* (b) ``bench_mirrored.py``: ``MirroredStrategy`` over 2 CPU replicas vs the hand-written
  loop in one process and vs DDP over 2 gloo processes, global batch 128 (throughput ratios,
  > 1 means MirroredStrategy is faster), with a check that it trains like the hand-written loop.
* (c) ``bench_multi_worker.py``: ``MultiWorkerMirroredStrategy`` over 2 gloo worker processes
  vs raw DDP over 2 gloo processes, global batch 128 (goal: throughput ours / DDP >= 0.99),
  with a check that it trains like DDP; and the all-reduce throughput of its gradient path
  vs a bare ``torch.distributed.all_reduce`` of the same bytes (1, 4, 16 MiB).

Each benchmark runs as a subprocess (its variants in processes of their own), so thread
settings and torch hooks never leak between measurements. ``make bench`` calls this script.

Run from the repository root: ``python benchmarks/run_all.py [--quick]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results.md")
TIMEOUT_S = 600

QUICK_ARGS = {
    "bench_one_device.py": ["--rounds", "3", "--steps", "10", "--warmup", "3"],
    "bench_mirrored.py": ["--rounds", "3", "--steps", "5", "--warmup", "2", "--check-steps", "3"],
    "bench_multi_worker.py": ["--quick"],
}
SCRIPTS = ("bench_one_device.py", "bench_mirrored.py", "bench_multi_worker.py")


def run(script: str, extra: list[str]) -> tuple[dict | None, str, int]:
    """Run one benchmark; its ``RESULT {...}`` line, its whole output, and its exit code."""
    cmd = [sys.executable, os.path.join(HERE, script), *extra]
    print(f"$ {' '.join(cmd)}", flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        output += f"\n{script} timed out after {TIMEOUT_S}s"
        code = 124
    result = None
    for line in output.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
        else:
            print("  " + line)
    return result, output, code


def machine_line(output: str) -> str:
    for line in output.splitlines():
        if line.startswith("# torch "):
            return line[2:]
    return ""


def table(one: dict | None, mirrored: dict | None, multi: dict | None, machine: str) -> str:
    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    sps = lambda s: f"{1 / s:.1f}"  # noqa: E731
    lines = [
        "# Benchmark results",
        "",
        f"{datetime.date.today().isoformat()}; {machine}. Seed CNN (TF tutorial), Adam, synthetic "
        "28x28x1 data; medians over interleaved rounds, each variant in its own process(es). "
        "Regenerate with `make bench`.",
        "",
        "| benchmark | variant | time / step | steps / s | ratio | goal |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    if one:
        lines += [
            f"| (a) one device, batch {one['global_batch']} | hand-written PyTorch | "
            f"{ms(one['hand_s_per_step'])} | {sps(one['hand_s_per_step'])} | | |",
            f"| | `OneDeviceStrategy(\"cpu\")` | {ms(one['ours_s_per_step'])} | "
            f"{sps(one['ours_s_per_step'])} | **{one['ratio_time_ours_over_hand']:.3f}** (time, ours / hand-written) | <= 1.01 |",
        ]
    else:
        lines.append("| (a) one device | failed | | | | |")
    if mirrored:
        m = mirrored
        lines += [
            f"| (b) 2 CPU replicas, global batch {m['global_batch']} | hand-written PyTorch, 1 process | "
            f"{ms(m['hand_s_per_step'])} | {sps(m['hand_s_per_step'])} | | |",
            f"| | DDP, 2 gloo processes x 1 thread | {ms(m['ddp_s_per_step'])} | {sps(m['ddp_s_per_step'])} | | |",
            f"| | `MirroredStrategy([\"cpu:0\", \"cpu:1\"])` | {ms(m['ours_s_per_step'])} | "
            f"{sps(m['ours_s_per_step'])} | **{m['throughput_ratio_ours_over_hand']:.2f}** vs hand-written, "
            f"**{m['throughput_ratio_ours_over_ddp']:.2f}** vs DDP (throughput, > 1: ours faster) | |",
        ]
    else:
        lines.append("| (b) mirrored | failed | | | | |")
    if multi:
        w = multi
        lines += [
            f"| (c) {w['workers']} workers, global batch {w['global_batch']} | DDP, {w['workers']} gloo "
            f"processes x 1 thread | {ms(w['ddp_s_per_step'])} | {sps(w['ddp_s_per_step'])} | | |",
            f"| | `MultiWorkerMirroredStrategy()`, {w['workers']} gloo workers x 1 thread | "
            f"{ms(w['ours_s_per_step'])} | {sps(w['ours_s_per_step'])} | "
            f"**{w['throughput_ratio_ours_over_ddp']:.3f}** (throughput, ours / DDP) | >= 0.99 |",
        ]
        for row in w["allreduce"]:
            size = f"{row['bytes'] / 2**20:.0f} MiB"
            lines += [
                f"| (c) gradient all-reduce, {size} float32, 2 workers | bare `dist.all_reduce` | "
                f"{ms(row['bare_s'])} | {row['bare_gbps']:.2f} GB/s | | |",
                f"| | bare + copies into / out of the flat tensor (as DDP) | {ms(row['copies_s'])} | "
                f"{row['copies_gbps']:.2f} GB/s | | |",
                f"| | ours: `strategy.run` of a step with no-op update | {ms(row['ours_s'])} | "
                f"{row['ours_gbps']:.2f} GB/s | **{row['ratio_ours_over_bare']:.2f}** vs bare, "
                f"{row['ratio_ours_over_copies']:.2f} vs bare + copies (throughput) | |",
            ]
    else:
        lines.append("| (c) multi-worker | failed | | | | |")
    lines.append("")
    if one:
        lines.append(
            f"(a) parameters after training: max abs diff ours vs hand-written "
            f"{one['param_max_abs_diff']:.1e} (bitwise equal expected)."
        )
    if mirrored:
        lines.append(
            f"(b) parameters after the {mirrored['steps_trained']} timed float32 steps, Mirrored vs "
            f"hand-written: max abs diff {mirrored['param_max_abs_diff']:.1e} (DDP vs hand-written: "
            f"{mirrored['ddp_param_max_abs_diff']:.1e}: summation order, amplified by Adam); "
            f"float64 check: {mirrored['f64_param_max_abs_diff']:.1e}."
        )
    if multi:
        lines.append(
            f"(c) parameters after the {multi['steps_trained']} timed float32 steps: MWMS worker 0 vs 1 "
            f"{multi['workers_param_max_abs_diff']:.1e}; MWMS vs DDP max abs diff "
            f"{multi['param_max_abs_diff_vs_ddp']:.1e} (bitwise equal expected); float64 check vs DDP: "
            f"{multi['f64_param_max_abs_diff_vs_ddp']:.1e}. All-reduce: GB/s = tensor bytes / time; ours "
            "is the whole time `strategy.run` adds to get the summed gradients into `.grad` (no backward "
            "to overlap with), see `bench_multi_worker.py`."
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds: a smoke test, not figures")
    args = parser.parse_args()
    outputs = {}
    results = {}
    codes = {}
    for script in SCRIPTS:
        extra = QUICK_ARGS[script] if args.quick else []
        results[script], outputs[script], codes[script] = run(script, extra)
    md = table(
        results["bench_one_device.py"],
        results["bench_mirrored.py"],
        results["bench_multi_worker.py"],
        next((line for line in map(machine_line, outputs.values()) if line), ""),
    )
    print()
    print(md)
    with open(RESULTS, "w") as f:
        f.write(md)
    print(f"written to {os.path.relpath(RESULTS)}")
    failed = [s for s, c in codes.items() if c != 0]
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
