"""``make gpu-report``'s plan: on a machine without a GPU it prints every step and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_report  # noqa: E402


def test_the_plan_fits_its_budget_and_names_every_step():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_report.py"), "--dry-run"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    for step in gpu_report.STEPS:
        assert step.name in out and step.limit_s <= gpu_report.STEP_LIMIT_S
        assert os.path.exists(os.path.join(ROOT, step.argv[0])) or step.argv[0] == "-m"
    assert sum(s.limit_s for s in gpu_report.STEPS) <= gpu_report.TOTAL_LIMIT_S
    assert "total" in out


@pytest.mark.skipif(gpu_report.gpu_present(), reason="this machine has a GPU: make gpu-report would run it")
def test_without_a_gpu_it_prints_the_plan_and_exits_0():
    out = subprocess.run(["make", "-s", "gpu-report", f"PYTHON={sys.executable}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "no CUDA GPU here" in out.stdout and "gpu-tests" in out.stdout


def test_unknown_steps_are_refused():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_report.py"), "--only", "nope"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown steps ['nope']" in out.stderr


def test_a_step_over_its_limit_is_reported_and_the_report_names_every_planned_step():
    slow = gpu_report.Step("slow", 1, ("-c", "print('half', flush=True); import time; time.sleep(30)"), "a stuck step")
    quick = gpu_report.Step("quick", 30, ("-c", "print('| a | b |')"), "a table")
    outcomes = [gpu_report.run_step(sys.executable, slow, 1), gpu_report.run_step(sys.executable, quick, 30)]
    assert outcomes[0].status == "timed out after 1 s" and outcomes[1].status == "ok"
    later = gpu_report.Step("later", 60, ("-c", "pass"), "never reached")
    text = gpu_report.render("2026-11-25", ["- GPU: test"], outcomes, [slow, quick, later])
    assert "| slow | a stuck step | timed out after 1 s |" in text
    assert "| later | never reached | not reached |" in text and "| a | b |" in text
