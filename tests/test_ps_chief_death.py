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


def _start(procs, chief_mode: str) -> tuple[dict, list]:
    cluster = cluster_config(1, 1)
    tasks = []
    for job, index in (("chief", 0), ("ps", 0), ("worker", 0)):
        config = {"cluster": cluster, "task": {"type": job, "index": index}}
        env = clean_env(TF_CONFIG=json.dumps(config))
        tasks.append(procs.spawn(["-c", JOB, chief_mode], env, f"{job}{index}"))
    return cluster, tasks


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, dict]:
    """The three clusters run at once (they mostly wait): the chief killed, the chief stopped,
    the chief finishing normally. ``{name: {"cluster", "codes", "outputs"}}``."""
    scenarios = {"killed": signal.SIGKILL, "frozen": signal.SIGSTOP, "finished": None}
    with processes(tmp_path_factory.mktemp("ps_chief")) as procs:
        started = {name: _start(procs, "return" if how is None else "hang")
                   for name, how in scenarios.items()}
        lost: dict[str, float] = {}
        end = time.monotonic() + 100
        while len(lost) < 2:  # signal each chief once it has trained
            for name, how in scenarios.items():
                chief = started[name][1][0]
                if how is not None and name not in lost and "CHIEF TRAINED 3" in procs.output(chief):
                    os.killpg(chief.pid, how)  # SIGSTOP: the process lives on, its connections stay open
                    lost[name] = time.monotonic()
            assert time.monotonic() < end, {n: procs.output(t[1][0])[-2000:] for n, t in started.items()}
            time.sleep(0.2)
        out = {}
        for name, (cluster, tasks) in started.items():
            waited = tasks if name == "finished" else tasks[1:]
            limit = 120 if name == "finished" else CHIEF_TIMEOUT + 30
            since = lost.get(name, time.monotonic())
            codes = [procs.wait(p, limit - (time.monotonic() - since)) for p in waited]
            out[name] = {"cluster": cluster, "codes": codes, "outputs": [procs.output(p) for p in waited]}
        return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("name", "what"), [("killed", "closed the connection"), ("frozen", "stopped answering")])
def test_servers_exit_nonzero_naming_the_chief_when_it_dies(outcomes, name, what):
    codes, outputs = outcomes[name]["codes"], outcomes[name]["outputs"]
    assert codes == [EXIT_CHIEF_LOST, EXIT_CHIEF_LOST], (codes, outputs)
    address = outcomes[name]["cluster"]["chief"][0]
    for task, output in zip(("ps:0", "worker:0"), outputs, strict=True):
        lines = [line for line in output.splitlines() if f"chief at {address}" in line]
        assert len(lines) == 1, output[-3000:]
        line = lines[0]
        assert line.startswith(f"[{task}] the chief at {address} {what}"), line
        assert f"exiting with status {EXIT_CHIEF_LOST}" in line, line
        assert "Traceback" not in output, output[-3000:]


@pytest.mark.timeout(200)
def test_every_task_exits_zero_when_the_chief_finishes(outcomes):
    codes, outputs = outcomes["finished"]["codes"], outcomes["finished"]["outputs"]
    assert codes == [0, 0, 0], (codes, [o[-2000:] for o in outputs])
    assert "CHIEF TRAINED 3" in outputs[0]
    for output in outputs[1:]:
        assert "chief at" not in output, output[-2000:]
