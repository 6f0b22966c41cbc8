"""A worker whose store calls are still blocked at exit ends with its own status, not SIGABRT.

A thread that returns from torch's store (C++) while the interpreter finalizes aborts the
process ("terminate called without an active exception"), which is what a stopped chief
leaves behind: the worker's calls to its store wait for answers that never come (they time
out later, possibly during the teardown). Here the
chief is a process that serves a ``TCPStore`` and is then stopped (SIGSTOP); workers build
a ``MultiWorkerMirroredStrategy`` against it and get ``WorkerUnavailableError`` naming worker
0. Each must exit with the status its program asked for: 1 for the uncaught exception, 3 for
a program that catches it and calls ``sys.exit(3)``, 0 for one that catches it and ends.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from torch_distribute.cluster.launcher import free_ports

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import proc_helpers as P  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="POSIX signals")

CHIEF = """
import sys, time, datetime
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=60))
print("serving", flush=True)
time.sleep(120)
"""
# The object is finalized after the atexit handlers, while the interpreter tears down (as a
# DataLoader's workers or a CUDA context may take seconds to): long enough for the blocked
# store call to time out and return then.
WORKER = """
import time

class SlowToFinalize:
    def __del__(self):
        time.sleep(4)

keep = SlowToFinalize()
import sys
import torch_distribute as td

def build():
    td.MultiWorkerMirroredStrategy(communication_options=td.CommunicationOptions(timeout_seconds=4))
    print("unexpectedly built", flush=True)

if sys.argv[1] == "uncaught":
    build()
try:
    build()
except td.WorkerUnavailableError as error:
    print("caught:", error, flush=True)
    if sys.argv[1] == "exit 3":
        sys.exit(3)
"""
ENDINGS = {"uncaught": 1, "exit 3": 3, "caught": 0}


@pytest.mark.timeout(150)
def test_a_worker_of_a_stopped_chief_exits_with_the_status_its_program_asked_for(tmp_path):
    port = free_ports(1)[0]
    cluster = {"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{free_ports(1)[0]}"]}
    env = P.clean_env(TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}}))
    with P.processes(tmp_path) as procs:
        chief = procs.spawn(["-c", CHIEF, str(port)], P.clean_env(), "chief")
        deadline = time.monotonic() + 60
        while "serving" not in procs.output(chief):
            assert time.monotonic() < deadline and chief.poll() is None, procs.output(chief)
            time.sleep(0.1)
        os.kill(chief.pid, signal.SIGSTOP)
        try:
            workers = {ending: procs.spawn(["-c", WORKER, ending], env, ending.replace(" ", "_"))
                       for ending in ENDINGS}
            for ending, worker in workers.items():
                code = procs.wait(worker, 60)
                text = procs.output(worker)
                assert code == ENDINGS[ending], f"{ending}: status {code}\n{text[-3000:]}"
                assert "WorkerUnavailableError" in text or "caught:" in text, text[-3000:]
                assert "worker 0" in text and "terminate called" not in text, text[-3000:]
                assert "ending this process now" not in text, text[-3000:]
        finally:
            os.kill(chief.pid, signal.SIGCONT)


# The last atexit handler (registered before torch_distribute is imported) lists the threads
# still running once the strategy has closed its process groups. torch._dynamo, imported after
# the process group exists (as torch.compile or an optimizer does), imports
# torch.distributed.nn.functional, whose default arguments would pin the default group.
FINISHING_WORKER = """
import atexit, os

def native_threads():
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{task}/comm").read().strip())
        except OSError:
            pass
    print("THREADS AT EXIT", sorted(names), flush=True)

atexit.register(native_threads)
import torch
import torch_distribute as td
strategy = td.MultiWorkerMirroredStrategy(communication_options=td.CommunicationOptions(timeout_seconds=30))
import torch._dynamo  # noqa: F401
with strategy.scope():
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

def step(x):
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()

strategy.run(step, args=(torch.ones(2, 4),))
print("finished", flush=True)
"""


@pytest.mark.timeout(150)
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="lists threads through /proc")
def test_no_process_group_outlives_a_finished_program(tmp_path):
    ports = free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    with P.processes(tmp_path) as procs:
        workers = [procs.spawn(["-c", FINISHING_WORKER], P.clean_env(TF_CONFIG=json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": rank}})), f"worker{rank}") for rank in range(2)]
        for worker in workers:
            code = procs.wait(worker, 90)
            text = procs.output(worker)
            assert code == 0 and "finished" in text, f"status {code}\n{text[-3000:]}"
            threads = [line for line in text.splitlines() if line.startswith("THREADS AT EXIT")]
            assert threads and "gloo" not in threads[0], text[-3000:]
