"""Workers that call different collectives get ``ReplicaMismatchError``, at once, on every worker.

Each scenario of ``tests/multiworker/mismatch_job.py`` runs as 2 worker processes (TF_CONFIG,
Gloo, CPU, ``timeout_seconds=10``); all scenarios start together and mostly wait. Checked:
the error type on both workers, that the message names what each worker called, and that it
came well before the collective timeout (the fingerprints are compared before the collective
runs, so nothing waits for a partner that will never come). Every process is killed at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from torch_distribute.cluster.launcher import free_ports

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mw_helpers as H  # noqa: E402
import proc_helpers as P  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")

JOB = str(Path(__file__).resolve().parent / "multiworker" / "mismatch_job.py")
TIMEOUT_S = 10
MODES = ["extra_reduce", "shape", "dtype", "gather", "skip_step", "double_step", "extra_forward",
         "early_end", "none"]
# FSDP2 gathers and reduce-scatters inside forward and backward, with no fingerprint of ours.
SHARDED_MODES = ["extra_reduce", "skip_step", "double_step", "extra_forward", "skip_scaled_step", "none"]


def _run_modes(directory: Path, modes: list[str], *extra: str) -> dict[str, dict[int, dict]]:
    """``{mode: {rank: report}}`` (a report holds ``code`` and ``text`` as well)."""
    with P.processes(directory) as procs:
        started: dict[str, list] = {}
        for mode in modes:
            cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]}
            meeting = ("--ready-dir", procs.meeting_place())
            started[mode] = [
                procs.spawn([JOB, "--mode", mode, "--timeout", str(TIMEOUT_S), *meeting, *extra],
                            P.clean_env(MW_RANK=str(rank), TF_CONFIG=json.dumps(
                                {"cluster": cluster, "task": {"type": "worker", "index": rank}})),
                            f"{mode}{rank}")
                for rank in range(2)]
        deadline = time.monotonic() + 150
        out: dict[str, dict[int, dict]] = {}
        for mode, pair in started.items():
            out[mode] = {}
            for rank, proc in enumerate(pair):
                code = procs.wait(proc, deadline - time.monotonic())
                text = procs.output(proc)
                report = H.parse_results(text).get(rank, {})
                out[mode][rank] = {**report, "code": code, "text": text[-3000:]}
        return out


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict[int, dict]]:
    return _run_modes(tmp_path_factory.mktemp("mismatch"), MODES)


@pytest.fixture(scope="module")
def sharded_reports(tmp_path_factory) -> dict[str, dict[int, dict]]:
    return _run_modes(tmp_path_factory.mktemp("sharded_mismatch"), SHARDED_MODES, "--sharded")


def _both_mismatch(reports: dict, mode: str) -> list[str]:
    messages = []
    for rank in range(2):
        report = reports[mode][rank]
        assert report["code"] == 17, report["text"]
        assert report["error"] == "ReplicaMismatchError", report["text"]
        assert report["blocked_s"] < TIMEOUT_S, report  # found at once, not after the timeout
        assert "worker 0:" in report["message"] and "worker 1:" in report["message"], report["message"]
        messages.append(report["message"])
    return messages


@pytest.mark.timeout(200)
def test_an_extra_reduce_on_one_worker(reports):
    for message in _both_mismatch(reports, "extra_reduce"):
        assert "worker 1: reduce of float32[3] at mismatch_job.py" in message, message
        assert "worker 0: optimizer step" in message, message


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode, mine, theirs", [
    ("shape", "reduce of float32[4]", "reduce of float32[2, 2]"),
    ("dtype", "reduce of float32[4]", "reduce of float64[4]"),
    ("gather", "gather of float32[2, 3]", "gather of float32[2, 4]"),
])
def test_same_collective_different_tensors(reports, mode, mine, theirs):
    """Same number of elements, or a dtype Gloo would abort on: named, never mixed."""
    for message in _both_mismatch(reports, mode):
        assert f"worker 0: {mine}" in message and f"worker 1: {theirs}" in message, message


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["skip_step", "double_step"])
def test_a_skipped_or_repeated_optimizer_step(reports, mode):
    for message in _both_mismatch(reports, mode):
        assert "worker 0: optimizer step" in message and "worker 1: optimizer step" in message, message


@pytest.mark.timeout(200)
def test_a_second_backward_on_one_worker(reports):
    """Gradient accumulation on one worker only: its step is compared afresh, and differs."""
    _both_mismatch(reports, "extra_forward")


@pytest.mark.timeout(200)
def test_a_worker_that_finished_early_is_a_program_bug_not_a_fault(reports):
    chief, other = reports["early_end"][0], reports["early_end"][1]
    assert other["code"] == 0 and other.get("finished"), other["text"]
    assert chief["code"] == 17 and chief["error"] == "ReplicaMismatchError", chief["text"]
    assert "worker(s) 1 finished their program" in chief["message"], chief["message"]
    assert "Restart the job" not in chief["message"]
    assert chief["blocked_s"] < TIMEOUT_S + 10


@pytest.mark.timeout(200)
def test_the_same_program_on_both_workers_runs_through(reports):
    first, second = reports["none"][0], reports["none"][1]
    assert first["code"] == 0 and second["code"] == 0, first["text"] + second["text"]
    assert first["params"] == second["params"]


def _exchange_reports(tmp_path: Path, world: int, *extra: str) -> dict[int, dict]:
    job = str(Path(__file__).resolve().parent / "multiworker" / "exchange_job.py")
    port = free_ports(1)[0]
    with P.processes(tmp_path) as procs:
        started = [procs.spawn([job, "--rank", str(r), "--world", str(world), "--port", str(port), *extra],
                               P.clean_env(), f"exchange{r}") for r in range(world)]
        return H.results_of_clean_exits(procs, started, 120)


def _expected(op: str, parts: list[torch.Tensor]) -> list:
    """The workers' values combined in rank order, in their dtype (as one process would)."""
    combine = {"SUM": torch.add, "MAX": torch.maximum, "MIN": torch.minimum}[op]
    result = parts[0]
    for part in parts[1:]:
        result = combine(result, part)
    if result.is_floating_point():
        return [float(v).hex() for v in result.double().tolist()]
    return [int(v) for v in result.tolist()]


@pytest.mark.timeout(180)
def test_small_reductions_ride_in_the_exchange_exactly_on_three_workers(tmp_path):
    """SUM, MAX and MIN of up to 8 values (float32, bfloat16, float64, int32, int64 beyond
    2**53, bool) give the same bits on every worker: the values combined in rank order in
    their dtype; a gather of uneven sizes; a flag raised on one worker."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "multiworker"))
    import exchange_job

    world = 3
    reports = _exchange_reports(tmp_path, world)
    parts = [exchange_job.values(rank) for rank in range(world)]
    for key, result in reports[0].items():
        if " " not in key:
            continue
        op, name = key.split(" ")
        assert result["values"] == _expected(op, [p[name] for p in parts]), key
        assert all(reports[rank][key] == result for rank in range(world)), key
    assert all(reports[rank]["any_true"] is True for rank in range(world))
    assert reports[1]["gather"] == [0.0.hex(), 1.0.hex(), 1.0.hex(), 2.0.hex(), 2.0.hex(), 2.0.hex()]


@pytest.mark.timeout(180)
def test_reductions_with_different_ops_are_a_mismatch(tmp_path):
    reports = _exchange_reports(tmp_path, 2, "--op-mismatch")
    for rank in range(2):
        mismatch = reports[rank]["mismatch"]
        assert mismatch is not None, reports[rank]
        assert "worker 0: loss of float32[2]" in mismatch["message"], mismatch["message"]
        assert mismatch["seconds"] < TIMEOUT_S


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode, mine, theirs", [
    ("skip_step", "optimizer step 4 of optimizer 0 (SGD)", "forward 5 of sharded module 0 (Linear"),
    ("double_step", "optimizer step 5 of optimizer 0 (SGD)", "forward 5 of sharded module 0 (Linear"),
    ("extra_forward", "optimizer step 4 of optimizer 0 (SGD)", "forward 5 of sharded module 0 (Linear"),
    ("extra_reduce", "forward 4 of sharded module 0 (Linear", "reduce of float32[3]"),
    # Loss scaling's inf/NaN check all-reduces a flag over the shards: compared first.
    ("skip_scaled_step", "loss scaling or clipping 4 of optimizer 0 (SGD", "forward 5 of sharded module 0 (Linear"),
])
def test_fully_sharded_steps_are_compared(sharded_reports, mode, mine, theirs):
    """FSDP2's own collectives carry no fingerprint: each sharded forward and optimizer step is
    agreed first, so a worker that goes its own way is named (before: a Gloo abort on a size
    mismatch; for a skipped or repeated step, a model silently left half-updated; for a
    skipped loss-scaled step, a timeout blamed on the chief)."""
    for message in _both_mismatch(sharded_reports, mode):
        assert f"worker 0: {mine}" in message and f"worker 1: {theirs}" in message, message


@pytest.mark.timeout(200)
def test_fully_sharded_program_runs_through_as_mirrored_does(sharded_reports, reports):
    first, second = sharded_reports["none"][0], sharded_reports["none"][1]
    assert first["code"] == 0 and second["code"] == 0, first["text"] + second["text"]
    assert first["params"] == second["params"]
    assert first["params"] == pytest.approx(reports["none"][0]["params"], abs=1e-6)
