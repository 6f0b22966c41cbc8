"""A failure is reported as what it is, on the worker that caused it, with the exit status the
program asked for: a program bug (one worker raising in its step) is not answered with
"restart", the launcher names the worker that failed first (not the one that exited first),
and a worker that catches the error and calls ``sys.exit(7)`` exits with 7.

The workers are ``tests/workers/habit_failure.py``: worker ``FAIL_RANK`` raises at step 3.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys

import pytest

from torch_distribute.cluster.launcher import free_ports, launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import proc_helpers as P  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "habit_failure.py")


@pytest.mark.timeout(240)
def test_a_worker_raising_in_its_step_is_named_as_a_program_error_not_a_restart(tmp_path):
    """Two jobs at once, started directly (TF_CONFIG): in one worker 1 raises, in the other the
    chief (which hosts the store that says who left and why) raises."""
    with P.processes(tmp_path) as procs:
        jobs = {}
        for failing in (1, 0):
            cluster = {"worker": [f"127.0.0.1:{port}" for port in free_ports(2)]}
            jobs[failing] = [procs.spawn([WORKER, "raise"], P.clean_env(FAIL_RANK=str(failing), TF_CONFIG=json.dumps(
                {"cluster": cluster, "task": {"type": "worker", "index": rank}})), f"fail{failing}-worker{rank}")
                for rank in range(2)]
        for failing, workers in jobs.items():
            other = 1 - failing
            codes = [procs.wait(worker, 180) for worker in workers]
            texts = [procs.output(worker) for worker in workers]
            assert codes[failing] == 1, texts[failing][-3000:]
            assert f"ValueError: bad batch on worker {failing}" in texts[failing]
            assert codes[other] == 7, f"status {codes[other]}\n{texts[other][-3000:]}"
            reported = next(line for line in texts[other].splitlines() if line.startswith("REPORTED"))
            assert reported.startswith("REPORTED PeerProgramError"), reported
            assert f"worker(s) {failing} raised an exception in the program" in reported
            assert f"ValueError: bad batch on worker {failing} (at {WORKER}:" in reported
            assert "restarting the job runs into it again" in reported and "Restart the job" not in reported


@pytest.mark.timeout(240)
def test_the_launcher_names_the_worker_that_failed_first_with_its_error(tmp_path):
    """Worker 1 raises, then takes 4 s to exit (a slow teardown): worker 0, which lost it as a
    partner, exits first; the launcher still names worker 1, with its error and exit status."""
    out, err = io.StringIO(), io.StringIO()
    code = launch([WORKER, "raise-slow"], 2, stdout=out, stderr=err, timeout=200, grace_period=3)
    text = err.getvalue()
    assert code == 1, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert re.search(r"worker rank 1 \(pid \d+\) failed with exit code 1 \(ValueError: bad batch on worker 1\)",
                     last), last
    assert "it failed first (worker rank 0 exited before it" in last, last


SIZE_CHECK = """
import torch_distribute as td
try:
    td.MultiWorkerMirroredStrategy(communication_options=td.CommunicationOptions(timeout_seconds=60))
except td.ClusterConfigError as error:
    print("REPORTED", error, flush=True)
"""


@pytest.mark.timeout(240)
def test_workers_started_with_different_cluster_sizes_are_told_so_at_once(tmp_path):
    """Worker 0 is given a cluster of 2, worker 1 one of 3 (same chief address): both say what
    differs, long before the 60 s a missing worker would be waited for."""
    ports = free_ports(3)
    clusters = {0: ports[:2], 1: ports}
    with P.processes(tmp_path) as procs:
        workers = {rank: procs.spawn(["-c", SIZE_CHECK], P.clean_env(TF_CONFIG=json.dumps(
            {"cluster": {"worker": [f"127.0.0.1:{p}" for p in clusters[rank]]}, "task": {"type": "worker", "index": rank}})),
            f"worker{rank}") for rank in (0, 1)}
        for worker in workers.values():
            assert procs.wait(worker, 50) == 0, procs.output(worker)[-3000:]
            reported = next(line for line in procs.output(worker).splitlines() if line.startswith("REPORTED"))
            assert "The workers were started with different views of the job (world size: " in reported, reported
            assert "2 (worker 0)" in reported and "3 (worker 1)" in reported, reported
            assert "restart" not in reported.lower(), reported


@pytest.mark.timeout(240)
def test_under_torchrun_the_status_is_the_programs_and_the_root_cause_is_the_worker_that_raised(tmp_path):
    """The same job under torchrun: worker 0 exits with the 7 it asked for, and torchrun's
    summary names worker 1's ValueError as the root cause (the records in its error files)."""
    with P.processes(tmp_path) as procs:
        job = procs.spawn(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_ports(1)[0]), WORKER, "raise-slow"], P.clean_env(), "torchrun")
        code = procs.wait(job, 200)
        text = procs.output(job)
    assert code == 1, text[-4000:]
    assert "REPORTED PeerProgramError" in text, text[-4000:]
    assert re.search(r"rank\s+: 0 \(local_rank: 0\)\n\s+exitcode\s+: 7 ", text), text[-4000:]
    root = text.split("Root Cause (first observed failure):", 1)[1]
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)", root) and "ValueError: bad batch on worker 1" in root, root
