"""Parameter-server tasks whose chief died exit non-zero and say so; a normal end exits 0.

A small cluster (chief, one ps, one worker) of real processes on loopback, each started by
the test (not by ``local_cluster``, whose supervisor would stop the other tasks itself when
the chief exits). The chief trains a few scheduled steps, then either returns normally (the
coordinator's shutdown stops the servers: every task exits 0) or is killed with SIGKILL: the
ps and worker tasks must then exit non-zero within their ``chief_timeout`` with one line on
stderr naming the chief's address and what happened. Every process is killed and reaped
whatever happens.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from proc_helpers import clean_env, processes

from torch_distribute.ps.local_cluster import cluster_config
from torch_distribute.ps.server import EXIT_CHIEF_LOST

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")

CHIEF_TIMEOUT = 4.0

# Every task runs this; the chief's behaviour comes from argv[1] ("return" or "hang"). The
# scheduled function is defined before distribute_server(): workers unpickle it from their
# own __main__.
JOB = f"""
import sys, time
import torch
import torch_distribute as td

def step(layer, optimizer):
    layer(torch.ones(3, 2)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return 1

if td.distribute_server(rpc_timeout=10, chief_timeout={CHIEF_TIMEOUT}):
    sys.exit(0)
strategy = td.ParameterServerStrategy(rpc_timeout=10, startup_timeout=60)
coordinator = td.coordinator.ClusterCoordinator(strategy)
with strategy.scope():
    layer = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
values = [coordinator.schedule(step, args=(layer, optimizer)) for _ in range(3)]
coordinator.join()
print("CHIEF TRAINED", sum(coordinator.fetch(values)), flush=True)
if sys.argv[1] == "hang":
    time.sleep(600)
"""


def _start(procs, tmp_path: Path, chief_mode: str) -> tuple[dict, list]:
    cluster = cluster_config(1, 1)
    tasks = []
    for job, index in (("chief", 0), ("ps", 0), ("worker", 0)):
        config = {"cluster": cluster, "task": {"type": job, "index": index}}
        env = clean_env(TF_CONFIG=json.dumps(config))
        tasks.append(procs.spawn(["-c", JOB, chief_mode], env, f"{job}{index}"))
    return cluster, tasks


def _wait_for(procs, proc, text: str, limit: float) -> None:
    end = time.monotonic() + limit
    while text not in procs.output(proc):
        assert proc.poll() is None, procs.output(proc)[-3000:]
        assert time.monotonic() < end, procs.output(proc)[-3000:]
        time.sleep(0.2)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("how", "what"), [(signal.SIGKILL, "closed the connection"),
                                           (signal.SIGSTOP, "stopped answering")],
                         ids=["killed", "frozen"])
def test_servers_exit_nonzero_naming_the_chief_when_it_dies(tmp_path, how, what):
    with processes(tmp_path) as procs:
        cluster, (chief, ps, worker) = _start(procs, tmp_path, "hang")
        _wait_for(procs, chief, "CHIEF TRAINED 3", limit=100)
        lost_at = time.monotonic()
        os.killpg(chief.pid, how)  # SIGSTOP: the process lives on, its connections stay open
        codes = [procs.wait(p, CHIEF_TIMEOUT + 30 - (time.monotonic() - lost_at)) for p in (ps, worker)]
        outputs = [procs.output(p) for p in (ps, worker)]
        assert codes == [EXIT_CHIEF_LOST, EXIT_CHIEF_LOST], (codes, outputs)
        address = cluster["chief"][0]
        for name, output in zip(("ps:0", "worker:0"), outputs, strict=True):
            lines = [line for line in output.splitlines() if f"chief at {address}" in line]
            assert len(lines) == 1, output[-3000:]
            line = lines[0]
            assert line.startswith(f"[{name}] the chief at {address} {what}"), line
            assert f"exiting with status {EXIT_CHIEF_LOST}" in line, line
            assert "Traceback" not in output, output[-3000:]


@pytest.mark.timeout(150)
def test_every_task_exits_zero_when_the_chief_finishes(tmp_path):
    with processes(tmp_path) as procs:
        _, tasks = _start(procs, tmp_path, "return")
        codes = [procs.wait(p, 120) for p in tasks]
        assert codes == [0, 0, 0], (codes, [procs.output(p)[-2000:] for p in tasks])
        assert "CHIEF TRAINED 3" in procs.output(tasks[0])
        for proc in tasks[1:]:
            assert "chief at" not in procs.output(proc), procs.output(proc)[-2000:]
