"""One worker of ``tests/test_two_hosts.py``, started by the launcher in a network namespace.

    python two_hosts_job.py --timeout S [--epochs E] [--endless [--step-sleep T]]

First the ``mw_helpers`` model and data for ``E`` epochs (MultiWorkerMirroredStrategy, one
CPU replica per worker); prints one ``THTRAIN {json}`` line with the initial and final
parameters and the losses. Without ``--endless`` it then exits normally.

With ``--endless`` it goes on training a tiny model step after step (``THSTEP {json}``
after each, with the wall-clock time) until a collective fails. On
``td.WorkerUnavailableError`` it prints one ``THRESULT {json}`` line (message, ``time.time()``
of the raise, the step) and re-raises: the exception is left uncaught, as in a user's
script, so the process ends through the library's own exit path (its ``atexit`` handler,
the interpreter's teardown). Whether that exit is prompt is part of what the test checks.

Diagnostics for hangs: SIGUSR1 dumps every thread's Python stack to stderr (the test sends
it before killing a worker that did not exit), and once the error is raised a watchdog
dumps the stacks again every ``--dump-after`` seconds while the process is still alive.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time

faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)  # before the slow imports

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mw_helpers as H  # noqa: E402

import torch_distribute as td  # noqa: E402

RESULT_PREFIX = "THRESULT "
TRAIN_PREFIX = "THTRAIN "
STEP_PREFIX = "THSTEP "

parser = argparse.ArgumentParser()
parser.add_argument("--timeout", type=float, required=True)
parser.add_argument("--endless", action="store_true")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--step-sleep", type=float, default=0.05)
parser.add_argument("--max-seconds", type=float, default=120.0)
parser.add_argument("--dump-after", type=float, default=15.0)
args = parser.parse_args()


def emit(prefix: str, payload: dict) -> None:
    print(prefix + json.dumps(payload), flush=True)


def train_equivalence(strategy: td.MultiWorkerMirroredStrategy, rank: int) -> dict:
    """``args.epochs`` epochs of the ``mw_helpers`` model, as ``mw_job.py`` trains it."""
    torch.manual_seed(H.worker_seed(rank))  # different on every worker: the chief's must win
    with strategy.scope():
        model = H.make_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=H.LR)
    init = H.flat(model)
    x, y = H.make_data()
    sizes = H.global_batch_sizes()
    dist_ds = strategy.experimental_distribute_dataset(H.make_loader(x, y))

    def step(batch, global_batch_size):
        xb, yb = batch
        per_example = F.cross_entropy(model(xb), yb, reduction="none")
        loss = td.compute_average_loss(per_example, global_batch_size=global_batch_size)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    losses = []
    for _ in range(args.epochs):
        for k, batch in enumerate(dist_ds):
            per_replica = strategy.run(step, args=(batch, sizes[k]))
            losses.append(float(strategy.reduce(td.ReduceOp.SUM, per_replica, axis=None)))
    return {"rank": rank, "num_replicas": strategy.num_replicas_in_sync,
            "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "init": init,
            "params": H.flat(model), "losses": losses}


def train_endless(strategy: td.MultiWorkerMirroredStrategy, rank: int, result: dict) -> None:
    """A tiny model, step after step, until a collective fails (or ``--max-seconds``)."""
    torch.manual_seed(H.worker_seed(rank))
    with strategy.scope():
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    strategy.set_loss_scaling_check(False)  # a per-replica mean, knowingly: any update will do

    def step(xb):
        model(xb).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    deadline = time.monotonic() + args.max_seconds
    k = 0
    while time.monotonic() < deadline:
        result["step"] = k
        strategy.run(step, args=(torch.randn(2, 4),))
        emit(STEP_PREFIX, {"rank": rank, "step": k, "time": time.time()})
        k += 1
        time.sleep(args.step_sleep)


torch.set_num_threads(1)
result: dict = {"rank": int(os.environ.get("RANK", "-1")), "phase": "start-up", "step": None}
try:
    strategy = td.MultiWorkerMirroredStrategy(
        devices=["cpu:0"], communication_options=td.CommunicationOptions(timeout_seconds=args.timeout))
    rank = strategy.cluster_resolver.worker_index
    result.update(rank=rank, phase="equivalence")
    emit(TRAIN_PREFIX, train_equivalence(strategy, rank))
    if not args.endless:
        sys.exit(0)
    result["phase"] = "endless"
    train_endless(strategy, rank, result)
    result["phase"] = "never cut"
    emit(RESULT_PREFIX, result)
    sys.exit(5)
except td.WorkerUnavailableError as error:
    result.update(error="WorkerUnavailableError", message=str(error), raised_at=time.time())
    emit(RESULT_PREFIX, result)
    # If the exit below hangs, say where, again and again, until the test kills us.
    faulthandler.dump_traceback_later(args.dump_after, repeat=True)
    raise
except SystemExit:
    raise
except BaseException as error:  # noqa: BLE001 - any other outcome is reported as wrong
    result.update(error=type(error).__name__, message=str(error), raised_at=time.time())
    emit(RESULT_PREFIX, result)
    faulthandler.dump_traceback_later(args.dump_after, repeat=True)
    raise
