"""``td.ps.create_in_process_cluster`` (issue 15, item 5): the tutorial's single-program
form trains, and the worker and ps children never outlive the coordinator, however it ends."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from proc_helpers import clean_env, processes

import torch_distribute as td

JOB = os.path.join(os.path.dirname(__file__), "workers", "ps_in_process_job.py")


#: The processes the cluster starts: two workers and a parameter server (fresh interpreters,
#: whatever ``TD_START_METHOD`` says).
STARTED_BY_THE_CLUSTER = 3


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie is dead, only not yet reaped


def _wait_gone(pids: list[int], limit: float) -> list[int]:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _line(text: str, prefix: str) -> object:
    for line in text.splitlines():
        if line.startswith(prefix):
            return json.loads(line[len(prefix):])
    raise AssertionError(f"no {prefix!r} line in:\n{text[-4000:]}")


def _wait_for(procs, proc, prefix: str, limit: float) -> object:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        text = procs.output(proc)
        if any(line.startswith(prefix) for line in text.splitlines()):
            return _line(text, prefix)
        assert proc.poll() is None, text[-4000:]
        time.sleep(0.2)
    raise AssertionError(f"no {prefix!r} within {limit} s:\n{procs.output(proc)[-4000:]}")


def _check_training(result) -> None:
    assert result["after"] < 0.2 * result["before"], result  # 20 asynchronous SGD steps
    assert sum(result["workers"].values()) == 20


@pytest.mark.timeout(120)
def test_tutorial_single_program_trains_and_leaves_no_child(tmp_path):
    with processes(tmp_path) as procs:
        env = clean_env()
        proc = procs.spawn([JOB, "--end", "normal"], env, "coordinator")
        code = procs.wait(proc, 100)
        text = procs.output(proc)
        assert code == 0, text[-4000:]
        pids = _line(text, "PIDS ")
        assert len(pids) == STARTED_BY_THE_CLUSTER
        _check_training(_line(text, "RESULT "))
        assert _wait_gone(pids, 5) == [], text[-4000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("end", ["sigkill"])  # also "raise", "sigterm": same paths as exit 0, SIGKILL
def test_children_end_with_the_coordinator(tmp_path, end):
    env = clean_env()
    with processes(tmp_path) as procs:
        mode = "raise" if end == "raise" else "hang"
        proc = procs.spawn([JOB, "--end", mode], env, "coordinator")
        pids = _wait_for(procs, proc, "PIDS ", 60)
        assert len(pids) == STARTED_BY_THE_CLUSTER
        _check_training(_wait_for(procs, proc, "RESULT ", 90))
        if end == "raise":
            assert procs.wait(proc, 30) == 1
            assert "the coordinator's program failed" in procs.output(proc)
        else:
            proc.send_signal(signal.SIGTERM if end == "sigterm" else signal.SIGKILL)
            assert procs.wait(proc, 10) is not None
        assert _wait_gone(pids, 5) == [], procs.output(proc)[-4000:]


def test_counts_are_checked():
    with pytest.raises(td.InvalidArgumentError, match="num_ps must be a positive integer"):
        td.ps.create_in_process_cluster(1, 0)
