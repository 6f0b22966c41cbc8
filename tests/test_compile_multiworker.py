"""Compiled training on 2 worker processes (MultiWorkerMirroredStrategy, Gloo on CPU).

Two jobs run once per module, each by ``python -m torch_distribute.launch --nproc 2`` with
``tests/workers/compiled_mwms.py``:

- ``2x1``: 2 workers x 1 CPU replica, ``@td.function`` on the distributed step, momentum SGD;
- ``2x2``: 2 workers x 2 CPU replicas (``devices=["cpu:0", "cpu:1"]`` per worker), first
  ``torch.compile(model)`` (made in the scope) called inside a plain replica step, no
  ``td.function``, then ``@td.function`` on the distributed step; Adam for both.

Each case trains 2 epochs on 37 examples in global batches of 8 (the last one ragged, 5
rows) and must end with the parameters of a one-process eager run on the same global
batches (1e-5), bitwise the same on every worker and every local copy, and compile no new
graph in the second epoch. Every job is bounded in time (a per-case watchdog in each worker,
the launcher's ``--timeout``, the wait here and the pytest timeout) and every process it
started is killed and reaped. Each worker prints a result line per case as soon as the case
ends, so a case that fails or hangs does not hide the results of the cases before it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

WORKERS = Path(__file__).resolve().parent / "workers"
sys.path.insert(0, str(WORKERS))
import compiled_mwms as W  # noqa: E402
import proc_helpers as P  # noqa: E402

pytestmark = [pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups"),
              pytest.mark.timeout(330)]

REPO = Path(__file__).resolve().parents[1]
WORKER = str(WORKERS / "compiled_mwms.py")
# A case running longer in a worker is a hang: the worker dumps its stacks, exits 1. A cold
# compile of 2 replicas in each of 2 workers took over 60 s on 2 loaded cores once.
CASE_TIMEOUT_S = 120
COLLECTIVE_TIMEOUT_S = 120  # CommunicationOptions(timeout_seconds=...): covers a compile's skew
LAUNCHER_TIMEOUT_S = 280  # the launcher stops its workers and exits 124 after this (2 cases)
WAIT_S = 300  # then this test kills everything
# Local replicas per worker: the cases of that job, in order (the plain torch.compile case first,
# so that a failing or hanging td.function does not take its result with it).
JOBS = {1: ["function_sgd"], 2: ["module_adam", "function_adam"]}
CASES = [pytest.param(1, "function_sgd", id="2x1-td.function-sgd"),
         pytest.param(2, "function_adam", id="2x2-td.function-adam"),
         pytest.param(2, "module_adam", id="2x2-compiled-module-adam")]


# -- process handling ----------------------------------------------------------------------
def _identity(pid: int) -> tuple[int, int] | None:
    """(pid, start time): names a process even after its pid is reused; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return pid, int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _kill(identities: set[tuple[int, int]]) -> None:
    """SIGKILL each process still alive as recorded, and its process group if it leads one."""
    for pid, started in identities:
        if _identity(pid) != (pid, started):
            continue  # exited (its pid may belong to someone else by now)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:  # the launcher starts each worker in its own session
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _run_job(replicas: int, log: Path) -> tuple[int | None, str]:
    """Launch 2 workers; return the launcher's exit code (None if killed here) and the output."""
    env = P.clean_env()
    argv = [sys.executable, "-u", "-m", "torch_distribute.launch", "--nproc", "2",
            "--timeout", str(LAUNCHER_TIMEOUT_S), "--grace-period", "2",
            WORKER, "--replicas", str(replicas), "--timeout", str(COLLECTIVE_TIMEOUT_S),
            "--case-timeout", str(CASE_TIMEOUT_S)]
    for case in JOBS[replicas]:
        argv += ["--case", case]
    seen: set[tuple[int, int]] = set()  # every process of the job, recorded while it runs
    code = None
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            seen.update(i for i in map(_identity, P.descendants(proc.pid)) if i is not None)
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.wait(timeout=0.5)
                break
    finally:
        if code is None:  # still running: the launcher first, so that it starts nothing more
            _kill({i for i in [_identity(proc.pid)] if i is not None})
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        _kill(seen)  # workers live in their own sessions: the launcher's group does not hold them
    return code, log.read_text()


def _parse(text: str) -> dict[str, dict[int, dict]]:
    """``{case: {rank: line}}`` from the launcher's output (lines prefixed ``[rank R] ``)."""
    out: dict[str, dict[int, dict]] = {}
    for line in text.splitlines():
        if line.startswith("[rank ") and "] " in line:
            line = line.split("] ", 1)[1]
        if line.startswith(W.RESULT_PREFIX):
            payload = json.loads(line[len(W.RESULT_PREFIX):])
            out.setdefault(payload["case"], {})[payload["rank"]] = payload
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """``jobs(replicas)``: (exit code, output, results by case) of that job, launched once."""
    done: dict[int, tuple[int | None, str, dict[str, dict[int, dict]]]] = {}

    def get(replicas: int):
        if replicas not in done:  # a failed job is not run again for the next test
            log = tmp_path_factory.mktemp(f"compiled_mwms_2x{replicas}") / "launch.log"
            code, text = _run_job(replicas, log)
            done[replicas] = code, text, _parse(text)
        return done[replicas]

    return get


@pytest.fixture(scope="module")
def references():
    return {name: W.train_reference(name) for name in ("sgd", "adam")}


def _case(jobs, replicas: int, case: str) -> dict[int, dict]:
    """Each worker's result of ``case``; fails with the job's output if one is missing."""
    code, text, results = jobs(replicas)
    lines = results.get(case, {})
    assert sorted(lines) == [0, 1], (
        f"{case}: no result from worker(s) {sorted({0, 1} - set(lines))}; launcher exit {code}:\n{text[-6000:]}")
    for rank, line in lines.items():
        assert line["num_replicas_in_sync"] == 2 * replicas
        assert "error" not in line, f"worker {rank}: {line['error']}"
    return {rank: line["result"] for rank, line in lines.items()}


# -- the checks ------------------------------------------------------------------------------
@pytest.mark.parametrize("replicas,case", CASES)
def test_compiled_training_matches_one_eager_process_and_workers_agree(jobs, references, replicas, case):
    got = _case(jobs, replicas, case)
    want = references[W.CASES[case][1]]
    sizes = W.global_batch_sizes()
    assert sizes[-1] == 5  # a ragged last batch
    chief = got[0]
    assert chief["init"] == want["init"]  # the chief's initial values, on every worker
    for rank, train in got.items():
        assert train["init"] == want["init"]
        assert train["steps_per_epoch"] == [len(sizes)] * W.EPOCHS
        assert len(train["local_shapes"]) == len(sizes) * W.EPOCHS
        assert train["params"] == chief["params"], f"worker {rank} differs from the chief"  # bitwise
        assert all(copy == train["params"] for copy in train["copies"]), f"worker {rank}: local copies differ"
        assert train["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-5)
    # Every global batch (the ragged one included) was split over all 2 x replicas replicas.
    rows = [sum(got[r]["local_shapes"][k][i] for r in got for i in range(replicas))
            for k in range(len(sizes) * W.EPOCHS)]
    assert rows == sizes * W.EPOCHS
    torch.testing.assert_close(torch.tensor(chief["params"]), torch.tensor(want["params"]), rtol=0, atol=1e-5)
    assert chief["params"] != want["init"]  # it did train


@pytest.mark.parametrize("replicas,case", CASES)
def test_the_second_epoch_compiles_no_new_graph(jobs, replicas, case):
    for rank, train in _case(jobs, replicas, case).items():
        first, second = train["graphs_after_epoch"]
        # At least a graph (it was compiled), and none in the second epoch. Under td.function
        # the local replicas share theirs: one, and one more per ragged split of the last batch
        # ([2, 1] rows: two). torch.compile on the module makes each replica trace its own, and
        # one more for the ragged batch.
        most = 3 if W.CASES[case][0] == "function" else 2 * replicas
        assert 1 <= first <= most, f"worker {rank}: {train['graphs_after_epoch']}"
        assert second - first == 0, f"worker {rank}: {train['graphs_after_epoch']}"
