"""``examples/gpt_fully_sharded.py`` under ``python -m torch_distribute.launch --nproc 2``.

A small GPT for a few steps, once with ``FullyShardedStrategy`` and once with
``MultiWorkerMirroredStrategy`` (the two launches run side by side). Checked: both workers
report, the loss falls, every worker holds about half of the parameters and optimizer state
under FSDP2 (all of it under MWMS), the workers report the same losses, and both strategies
train the same model alike. Every process started here (each launcher runs in its own
session) is killed and reaped whatever happens.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import proc_helpers as P  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/gpt_fully_sharded.py"
PREFIX = "GPTRESULT "
STEPS = 15
FLAGS = ["--steps", str(STEPS), "--layers", "2", "--width", "64", "--seq-len", "32",
         "--global-batch-size", "8", "--lr", "3e-3", "--val-batches", "2", "--log-every", "5"]
LAUNCH_TIMEOUT_S = 70  # the launcher stops its workers after this
WAIT_S = 85  # then this test kills the launcher's whole tree


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Both strategies launched at once; ``{strategy: {"code", "text", "results"}}``."""
    with P.processes(tmp_path_factory.mktemp("gpt")) as procs:
        started = {strategy: procs.spawn(
            ["-m", "torch_distribute.launch", "--nproc", "2", "--timeout", str(LAUNCH_TIMEOUT_S),
             "--grace-period", "2", EXAMPLE, "--strategy", strategy, *FLAGS], P.clean_env(), strategy)
            for strategy in ("fully_sharded", "multi_worker_mirrored")}
        deadline = time.monotonic() + WAIT_S
        out = {}
        for strategy, proc in started.items():
            code = procs.wait(proc, deadline - time.monotonic())
            text = procs.output(proc)
            out[strategy] = {"code": code, "text": text, "results": P.parse_results(text, PREFIX)}
        return out


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
