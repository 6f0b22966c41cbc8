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
* (d) ``bench_compile.py``: compiled steps, global batch 64: ``@td.function`` on the
  distributed step under ``OneDeviceStrategy`` and ``MirroredStrategy`` (2 CPU replicas) vs
  the hand-written ``torch.compile`` loop (compiled model, or compiled step function) and the
  eager loops (goal: speed hand-compiled / ``td.function`` >= 0.98), with compile seconds, the
  graphs compiled and the parameters vs the hand-written eager loop.
* (e) ``bench_fully_sharded.py``: ``FullyShardedStrategy`` over 2 gloo worker processes vs
  hand-written FSDP2 (``fully_shard``) and vs ``MultiWorkerMirroredStrategy``, on the GPT of
  ``examples/gpt_fully_sharded.py`` (goal: throughput ours / hand-written FSDP2 >= 0.97), with
  each worker's bytes of parameters + optimizer state and peak RSS, and a check that it
  trains like the hand-written FSDP2 (bitwise equal parameters).

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
TIMEOUT_S_PER_SCRIPT = {"bench_compile.py": 900, "bench_fully_sharded.py": 900}  # cold compiles, twice per compiling variant

QUICK_ARGS = {
    "bench_one_device.py": ["--rounds", "3", "--steps", "10", "--warmup", "3"],
    "bench_mirrored.py": ["--rounds", "3", "--steps", "5", "--warmup", "2", "--check-steps", "3"],
    "bench_multi_worker.py": ["--quick"],
    "bench_compile.py": ["--quick"],
    "bench_fully_sharded.py": ["--quick"],
}
SCRIPTS = ("bench_one_device.py", "bench_mirrored.py", "bench_multi_worker.py", "bench_compile.py",
           "bench_fully_sharded.py")


def run(script: str, extra: list[str]) -> tuple[dict | None, str, int]:
    """Run one benchmark; its ``RESULT {...}`` line, its whole output, and its exit code."""
    cmd = [sys.executable, os.path.join(HERE, script), *extra]
    print(f"$ {' '.join(cmd)}", flush=True)
    timeout = TIMEOUT_S_PER_SCRIPT.get(script, TIMEOUT_S)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        output += f"\n{script} timed out after {timeout}s"
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


def table(one: dict | None, mirrored: dict | None, multi: dict | None, machine: str,
          compiled: dict | None = None, sharded: dict | None = None) -> str:
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
    if compiled:
        lines += compiled_rows(compiled)
    else:
        lines.append("| (d) compiled steps | failed | | | | |")
    if sharded:
        lines += fully_sharded_rows(sharded)
    else:
        lines.append("| (e) fully sharded | failed | | | | |")
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
    if compiled:
        lines.append(compiled_note(compiled))
    if sharded:
        lines.append(fully_sharded_note(sharded))
    return "\n".join(lines) + "\n"


COMPILED_LABELS = {
    "hand-eager": "hand-written PyTorch, eager",
    "hand-compiled": "hand-written, `torch.compile(model)`",
    "hand-compiled-step": "hand-written, `torch.compile(step)`",
    "one-eager": "`OneDeviceStrategy(\"cpu\")`, eager",
    "one-function": "`OneDeviceStrategy(\"cpu\")`, `@td.function`",
    "mirrored-eager": "`MirroredStrategy([\"cpu:0\", \"cpu:1\"])`, eager",
    "mirrored-function": "`MirroredStrategy([\"cpu:0\", \"cpu:1\"])`, `@td.function`",
    "mirrored-compiled": "`MirroredStrategy([\"cpu:0\", \"cpu:1\"])`, `torch.compile(model)` in scope",
}


def compiled_rows(c: dict) -> list[str]:
    """(d): one row per variant; the ratio column gives speed vs the hand-written compiled loop."""
    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    rows = []
    first = True
    for name, v in c["variants"].items():
        label = COMPILED_LABELS.get(name, name)
        if v["graphs"]:
            label += f" ({v['first_call_s']:.0f} s first call, {v['graphs']} graph{'s' if v['graphs'] > 1 else ''})"
        ratio, goal = "", ""
        if name != "hand-eager":
            bold = "**" if name.endswith("-function") else ""
            ratio = (f"{bold}{v['speed_vs_hand_compiled']:.2f}{bold} vs {c['baseline']}, "
                     f"{v['speed_vs_hand_eager']:.2f} vs hand-eager (speed)")
        if name == "one-function":
            goal = f">= {c['goal_speed_vs_hand_compiled']}"
        head = f"| (d) compiled steps, batch {c['global_batch']}" if first else "|"
        first = False
        rows.append(f"{head} | {label} | {ms(v['s_per_step'])} | {1 / v['s_per_step']:.1f} | {ratio} | {goal} |")
    return rows


def compiled_note(c: dict) -> str:
    note = (
        f"(d) speed = reference time / variant time (> 1: the variant is faster); baseline "
        f"{c['baseline']}, the faster hand-written compiled loop; first calls compile with the inductor "
        f"caches {'disabled' if c['cold_compile'] else 'kept'}."
    )
    others = {name: v for name, v in c["variants"].items() if name != "hand-eager"}
    if c["check_steps"]:
        diffs = ", ".join(f"{name} {v['fresh_param_max_abs_diff']:.1e} / {v['fresh_param_rel_l2_diff']:.1e}"
                          for name, v in others.items())
        note += (
            f" Parameters vs hand-eager after {c['check_steps']} fresh float32 steps (max abs / relative L2): "
            f"{diffs}. Where dynamo traces Adam's update (compiled step, and `td.function` on one "
            "replica), it computes the bias corrections in float32; Adam amplifies that on near-zero "
            "gradients (see `bench_compile.py`)."
        )
    return note


FULLY_SHARDED_ORDER = ("FSDP2", "FSDP2-reshard-all", "ours", "ours-unchecked", "MWMS")


def fully_sharded_rows(f: dict) -> list[str]:
    """(e): one row per variant; the ratio column gives ours' throughput over the variant's."""
    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    m = f["model"]
    rows = []
    for k, name in enumerate(FULLY_SHARDED_ORDER):
        v = f["variants"][name]
        head = (f"| (e) {f['workers']} workers, GPT {m['layers']}x{m['width']}, context {m['seq_len']}, "
                f"global batch {f['global_batch']}") if k == 0 else "|"
        ratio, goal = "", ""
        if name == "FSDP2":
            ratio = f"**{f['throughput_ratio_ours_over_fsdp2']:.3f}** (throughput, ours / this)"
            goal = ">= 0.97"
        elif name != "ours":
            ratio = f"{v['throughput_ours_over_this']:.3f} (throughput, ours / this)"
        rows.append(f"{head} | {v['label']} | {ms(v['s_per_step'])} | {1 / v['s_per_step']:.2f} | {ratio} | {goal} |")
    return rows


def fully_sharded_note(f: dict) -> str:
    mib = 2**20
    parts = []
    for name in FULLY_SHARDED_ORDER:
        v = f["variants"][name]
        held = max(v["local_bytes"])
        parts.append(
            f"{name} {held / mib:.1f} MiB ({held / v['whole_bytes']:.2f} of {v['whole_bytes'] / mib:.1f}), "
            f"peak RSS {max(v['peak_rss']) / mib:.0f} MiB (+{max(v['peak_rss_over_start']) / mib:.0f} "
            "over the RSS before the model)")
    diffs = ", ".join(f"{name} {f['variants'][name]['param_max_abs_diff_vs_ours']:.1e}"
                      for name in FULLY_SHARDED_ORDER if name != "ours")
    m = f["model"]
    return (
        f"(e) GPT of `examples/gpt_fully_sharded.py` ({m['parameters']:,} parameters, AdamW), "
        f"2 gloo processes x 1 thread per variant, {f['rounds']} rounds of {f['steps']} steps. Per worker, "
        f"parameters + optimizer state held (largest worker) and peak RSS: {'; '.join(parts)}. "
        f"Parameters after the {f['steps_trained']} timed steps vs ours, max abs diff: {diffs} "
        "(bitwise equal expected for the hand-written FSDP2)."
    )


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
        results["bench_compile.py"],
        results["bench_fully_sharded.py"],
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
