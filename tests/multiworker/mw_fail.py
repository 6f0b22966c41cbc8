"""One worker of a failure test; prints one ``MWRESULT {json}`` line, then exits at once.

    python mw_fail.py --timeout S [--fail-rank R --mode exit|stop|kill --at K] [--ready-dir D]

Trains a tiny model step after step. At step ``K`` worker ``R`` either dies of an uncaught
exception (``exit``: a crash, exit status 1), stops itself with SIGSTOP (``stop``: alive but
silent) or kills itself with SIGKILL (``kill``: gone without a word). The
others must raise ``WorkerUnavailableError``; they report its message and how long they were
blocked. A worker alone (the others never started) reports the start-up error.

With ``--ready-dir`` the workers first wait (up to 120 s) until both have imported torch: on
two loaded cores one interpreter can start more than ``--timeout`` seconds after the other, and
these jobs are about failures in training, not a late start.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mw_helpers as H  # noqa: E402
import proc_helpers as P  # noqa: E402

import torch_distribute as td  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--timeout", type=float, required=True)
parser.add_argument("--fail-rank", type=int, default=None)
parser.add_argument("--mode", choices=["exit", "stop", "kill"], default=None)
parser.add_argument("--at", type=int, default=3)
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--ready-dir", default=None, help="meet the other worker here before starting")
parser.add_argument("--natural-exit", action="store_true",
                    help="after reporting, leave through the interpreter's normal exit (atexit, teardown)")
args = parser.parse_args()


class InjectedFailure(Exception):
    """The crash of the failing worker: left uncaught, so the process exits as a crash does."""


torch.set_num_threads(1)
if args.ready_dir:
    P.meet(args.ready_dir, os.environ["MW_RANK"], 2)
result: dict = {"rank": int(os.environ.get("MW_RANK", "-1")), "phase": "start-up", "step": None}
started = time.monotonic()
try:
    strategy = td.MultiWorkerMirroredStrategy(
        devices=["cpu:0"], communication_options=td.CommunicationOptions(timeout_seconds=args.timeout))
    rank = strategy.cluster_resolver.worker_index
    result["rank"] = rank
    torch.manual_seed(H.worker_seed(rank))
    with strategy.scope():
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    # A per-replica mean, knowingly: this job is about failures, not the update's scale.
    strategy.set_loss_scaling_check(False)

    def step(x):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    result["phase"] = "training"
    for k in range(args.steps):
        result["step"] = k
        if k == args.at and rank == args.fail_rank:
            print(f"worker {rank} failing at step {k}", flush=True)
            if args.mode == "exit":
                raise InjectedFailure(f"worker {rank} crashes at step {k}")
            os.kill(os.getpid(), signal.SIGKILL if args.mode == "kill" else signal.SIGSTOP)
        started = time.monotonic()
        strategy.run(step, args=(torch.randn(2, 4),))
    result["phase"] = "finished"
    code = 0
except td.WorkerUnavailableError as error:
    result.update(error="WorkerUnavailableError", message=str(error))
    code = 17
except (SystemExit, InjectedFailure):
    raise
except BaseException as error:  # noqa: BLE001 - any other outcome is reported as wrong
    result.update(error=type(error).__name__, message=str(error))
    code = 18
result["blocked_s"] = time.monotonic() - started
H.emit(result)
sys.stdout.flush()
sys.stderr.flush()
if args.natural_exit:
    sys.exit(code)
os._exit(code)  # no interpreter teardown against a dead or silent peer
