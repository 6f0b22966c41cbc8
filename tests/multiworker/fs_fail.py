"""One worker of a ``FullyShardedStrategy`` failure test; prints one ``FSRESULT {json}`` line.

    python fs_fail.py --timeout S --kill-rank R --at K [--linger S] [--ready-dir D --workers N]

Trains the tiny transformer step after step. At step ``K`` worker ``R`` kills itself with
SIGKILL (no exit handler runs, no "left" mark in the store: it just vanishes). The others
must raise ``WorkerUnavailableError`` naming it; they report the message, the step and how
long that step was blocked, then stay alive for ``--linger`` seconds (so that a survivor
that is also the chief keeps the rendezvous store up while the others describe the failure;
the test kills them once it has read their results). With ``--ready-dir`` the ``N`` workers
first meet there after ``import torch`` (several jobs start at once on two cores; a late start
is not what these jobs test).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fs_model as M  # noqa: E402
import proc_helpers as P  # noqa: E402  (on the path fs_model puts tests/ on)

import torch_distribute as td  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--timeout", type=float, required=True)
parser.add_argument("--kill-rank", type=int, required=True)
parser.add_argument("--at", type=int, default=3)
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--linger", type=float, default=60)
parser.add_argument("--ready-dir", default=None, help="meet the other workers here before starting")
parser.add_argument("--workers", type=int, default=2, help="how many meet in --ready-dir")
args = parser.parse_args()

torch.set_num_threads(1)
if args.ready_dir:
    P.meet(args.ready_dir, os.environ["FS_RANK"], args.workers)
result: dict = {"rank": int(os.environ.get("FS_RANK", "-1")), "phase": "start-up", "step": None}
started = time.monotonic()
code = 0
try:
    strategy = td.FullyShardedStrategy(
        communication_options=td.CommunicationOptions(timeout_seconds=args.timeout))
    rank = strategy.extended.worker_index
    result["rank"] = rank
    torch.manual_seed(M.worker_seed(rank))
    with strategy.scope():
        model = M.make_model()
        optimizer = M.make_optimizer(model.parameters())
    x, y = M.make_data()
    shard = slice(rank * 2, rank * 2 + 2)  # 2 rows of each global batch of 2 x num_workers

    def step():
        loss = td.compute_average_loss(M.per_example_loss(model, x[shard], y[shard]),
                                       global_batch_size=2 * strategy.num_replicas_in_sync)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    result["phase"] = "training"
    for k in range(args.steps):
        result["step"] = k
        if k == args.at and rank == args.kill_rank:
            print(f"worker {rank} killing itself at step {k}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        started = time.monotonic()
        strategy.reduce(td.ReduceOp.SUM, strategy.run(step), axis=None)
    result["phase"] = "finished"
except td.WorkerUnavailableError as error:
    result.update(error="WorkerUnavailableError", message=str(error))
    code = 17
except BaseException as error:  # noqa: BLE001 - any other outcome is reported as wrong
    result.update(error=type(error).__name__, message=str(error))
    code = 18
result["blocked_s"] = time.monotonic() - started
M.emit(result)
sys.stderr.flush()
time.sleep(args.linger)
os._exit(code)  # no interpreter teardown against a dead peer
