"""``examples/gpt_fully_sharded.py`` under ``python -m torch_distribute.launch --nproc 2``.

A small GPT for a few steps, once with ``FullyShardedStrategy`` and once with
``MultiWorkerMirroredStrategy`` (the two launches run side by side). Checked: both workers
report, the loss falls, every worker holds about half of the parameters and optimizer state
under FSDP2 (all of it under MWMS), the workers report the same losses, and both strategies
train the same model alike. Every process started here (each launcher runs in its own
session) is killed and reaped whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torch_distribute.cluster.launcher import TORCHRUN_VARS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mw_helpers as H  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/gpt_fully_sharded.py"
PREFIX = "GPTRESULT "
STEPS = 15
FLAGS = ["--steps", str(STEPS), "--layers", "2", "--width", "64", "--seq-len", "32",
         "--global-batch-size", "8", "--lr", "3e-3", "--val-batches", "2", "--log-every", "5"]
LAUNCH_TIMEOUT_S = 70  # the launcher stops its workers after this
WAIT_S = 85  # then this test kills the launcher's whole tree


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s session and every descendant (if it still runs), then reap it."""
    if proc.poll() is None:
        for pid in [proc.pid, *H.descendants(proc.pid)]:
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _results(text: str) -> dict[int, dict]:
    out = {}
    for line in text.splitlines():
        if line.startswith("[rank "):
            line = line.split("] ", 1)[1] if "] " in line else line
        if line.startswith(PREFIX):
            payload = json.loads(line[len(PREFIX):])
            out[payload["rank"]] = payload
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Both strategies launched at once; ``{strategy: {"code", "text", "results"}}``."""
    log_dir = tmp_path_factory.mktemp("gpt")
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and k != "TF_CONFIG"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs: dict[str, tuple[subprocess.Popen, Path]] = {}
    try:
        for strategy in ("fully_sharded", "multi_worker_mirrored"):
            log = log_dir / f"{strategy}.log"
            with open(log, "w") as out:
                procs[strategy] = (subprocess.Popen(
                    [sys.executable, "-u", "-m", "torch_distribute.launch", "--nproc", "2",
                     "--timeout", str(LAUNCH_TIMEOUT_S), "--grace-period", "2",
                     EXAMPLE, "--strategy", strategy, *FLAGS],
                    env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True), log)
        deadline = time.monotonic() + WAIT_S
        out = {}
        for strategy, (proc, log) in procs.items():
            try:
                code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
            text = log.read_text()
            out[strategy] = {"code": code, "text": text, "results": _results(text)}
        return out
    finally:
        for proc, _ in procs.values():
            _kill_tree(proc)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["fully_sharded", "multi_worker_mirrored"])
def test_both_workers_train_and_agree(runs, strategy):
    run = runs[strategy]
    assert run["code"] == 0, run["text"][-4000:]
    results = run["results"]
    assert sorted(results) == [0, 1], run["text"][-4000:]
    r0, r1 = results[0], results[1]
    assert r0["workers"] == 2 and r0["steps"] == STEPS
    # The logged loss is the global one (strategy.reduce): the same on every worker.
    assert r0["losses"] == r1["losses"] and r0["val_loss"] == r1["val_loss"]
    assert r0["first_loss"] == r0["losses"][0] and r0["last_loss"] == r0["losses"][-1]
    assert all(math.isfinite(v) for v in r0["losses"]) and math.isfinite(r0["val_loss"])
    # The loss falls: from ~log(vocabulary) to well below it.
    first, last3 = r0["losses"][0], sum(r0["losses"][-3:]) / 3
    assert first > 4.0 and last3 < first - 0.8, r0["losses"]
    assert "[rank 0] step   15  loss" in run["text"] and "[rank 0] validation loss" in run["text"]


@pytest.mark.timeout(150)
def test_fully_sharded_holds_half_of_the_state_per_worker(runs):
    sharded = runs["fully_sharded"]["results"]
    mirrored = runs["multi_worker_mirrored"]["results"]
    assert sorted(sharded) == [0, 1] and sorted(mirrored) == [0, 1]
    whole = sharded[0]["whole_bytes"]
    assert whole == sharded[1]["whole_bytes"] == mirrored[0]["whole_bytes"] > 0
    for rank in (0, 1):
        assert sharded[rank]["local_bytes"] <= whole / 2 * 1.10, sharded[rank]
        assert mirrored[rank]["local_bytes"] == whole  # every MWMS worker holds it all
    # Shards cover the whole state (FSDP2 pads a dim 0 that does not split evenly).
    assert sharded[0]["local_bytes"] + sharded[1]["local_bytes"] >= whole * 0.99


@pytest.mark.timeout(150)
def test_fully_sharded_trains_like_multi_worker_mirrored(runs):
    """Same initial weights (the chief's), batches and summed gradients: the same losses up
    to float32 summation order."""
    sharded = runs["fully_sharded"]["results"]
    mirrored = runs["multi_worker_mirrored"]["results"]
    assert sorted(sharded) == [0, 1] and sorted(mirrored) == [0, 1]
    a, b = sharded[0]["losses"], mirrored[0]["losses"]
    assert a[0] == pytest.approx(b[0], abs=1e-5)
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-3, (a, b)
    assert sharded[0]["val_loss"] == pytest.approx(mirrored[0]["val_loss"], abs=1e-3)
