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
    assert sum(s.estimate_s for s in gpu_report.STEPS) <= gpu_report.TOTAL_LIMIT_S
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


def test_every_step_has_an_estimate_within_its_limit_and_groups_name_real_steps():
    names = {s.name for s in gpu_report.STEPS}
    assert len(names) == len(gpu_report.STEPS)
    for step in gpu_report.STEPS:
        assert 0 < step.estimate_s <= step.limit_s <= gpu_report.STEP_LIMIT_S, step.name
    for group, members in gpu_report.GROUPS.items():
        assert set(members) <= names and group not in names
    assert [s.name for s in gpu_report.select("issue45")] == list(gpu_report.GROUPS["issue45"])
    assert [s.name for s in gpu_report.select("precision,gpu-tests,precision")] == ["precision", "gpu-tests"]
    assert gpu_report.select("") == list(gpu_report.STEPS)


def test_a_step_is_planned_only_where_its_estimate_fits_and_a_later_shorter_one_still_can():
    step = lambda name, estimate: gpu_report.Step(name, 500, ("-c", "pass"), name, estimate)  # noqa: E731
    steps = [step("a", 200), step("b", 300), step("c", 100)]
    assert gpu_report.fits(steps, 600) == [True, True, True]
    assert gpu_report.fits(steps, 350) == [True, False, True]  # b skipped, c still fits
    assert gpu_report.fits(steps, 50) == [False, False, False]
    text = gpu_report.plan(steps, 350)
    assert "b" in text and text.count("[skipped: does not fit the budget]") == 1 and "300" in text


def test_the_issue45_checks_fit_a_15_minute_lease_in_two_calls_of_at_most_10_minutes():
    """The split the module docstring gives: each call's estimates fit its budget, each budget a
    call of at most 10 minutes, and both with a machine start (up to 2 minutes) in 15."""
    first = gpu_report.select("cyclegan-compiled,cyclegan-best")
    second = gpu_report.select("fully-sharded-profile,resnet-compiled,cyclegan-best-batch8")
    assert all(gpu_report.fits(first, 540))
    assert gpu_report.fits(second, 300) == [True, True, False]  # batch 8 only with time over
    used = sum(s.estimate_s for s in first) + sum(s.estimate_s for s in second[:2])
    assert used + 120 <= 15 * 60 and 540 <= 600 and 300 <= 600
    assert {s.name for s in first + second} == set(gpu_report.GROUPS["issue45"])


def test_the_issue45_steps_pass_options_their_benchmarks_define():
    """Each option a step passes is one its benchmark's parser defines (read from the source:
    running the three scripts' --help would import torch three times)."""
    for step in gpu_report.select("issue45"):
        with open(os.path.join(ROOT, step.argv[0])) as f:
            source = f.read()
        for option in (a for a in step.argv[1:] if a.startswith("--")):
            assert f'add_argument("{option}"' in source, (step.name, option)


def test_a_step_over_its_limit_is_reported_and_the_report_names_every_planned_step():
    slow = gpu_report.Step("slow", 1, ("-c", "print('half', flush=True); import time; time.sleep(30)"), "a stuck step",
                           1)
    quick = gpu_report.Step("quick", 30, ("-c", "print('| a | b |')"), "a table", 1)
    outcomes = [gpu_report.run_step(sys.executable, slow, 1), gpu_report.run_step(sys.executable, quick, 30)]
    assert outcomes[0].status == "timed out after 1 s" and outcomes[1].status == "ok"
    later = gpu_report.Step("later", 60, ("-c", "pass"), "never reached", 1)
    text = gpu_report.render("2026-11-25", ["- GPU: test"], outcomes, [slow, quick, later])
    assert "| slow | a stuck step | timed out after 1 s |" in text
    assert "| later | never reached | not reached |" in text and "| a | b |" in text
