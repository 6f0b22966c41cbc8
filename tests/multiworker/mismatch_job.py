"""One worker of a program whose workers call different collectives; prints one ``MWRESULT``.

    python mismatch_job.py --mode MODE --timeout S [--off] [--sharded] [--ready-dir D]

Trains a tiny model under ``MultiWorkerMirroredStrategy`` (one CPU replica per worker), or
``FullyShardedStrategy`` with ``--sharded``. At step ``AT`` the workers part ways as ``MODE``
says:

- ``extra_reduce``: worker 1 reduces a tensor the other does not;
- ``shape``: both reduce, worker 0 a float32[4], worker 1 a float32[2, 2];
- ``dtype``: both reduce, worker 0 a float32[4], worker 1 a float64[4];
- ``gather``: both gather along 0, worker 0 a [2, 3], worker 1 a [2, 4];
- ``skip_step``: worker 1 does not call ``optimizer.step()``;
- ``double_step``: worker 0 calls ``optimizer.step()`` twice;
- ``skip_scaled_step``: ``skip_step`` with a ``td.mixed_precision.LossScaleOptimizer``
  (its inf/NaN check is a collective of its own under ``--sharded``);
- ``extra_forward``: worker 1 runs forward and backward twice before its step;
- ``early_end``: worker 1 stops training (and exits normally) after ``AT`` steps;
- ``none``: nobody; both finish.

Each worker reports the error it got, its message and how long it was blocked, and its
parameters (to check that nothing diverged before the error; under ``--sharded`` the whole
parameters only after a normal end, since gathering them is a collective, else its shards).
With ``--ready-dir`` the two workers meet there after ``import torch``: many jobs start at once
on two cores, and a late start is not what these jobs test.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mw_helpers as H  # noqa: E402
import proc_helpers as P  # noqa: E402

import torch_distribute as td  # noqa: E402

AT = 3
STEPS = 8

parser = argparse.ArgumentParser()
parser.add_argument("--mode", required=True)
parser.add_argument("--timeout", type=float, required=True)
parser.add_argument("--off", action="store_true", help="CommunicationOptions(verify_collectives=False)")
parser.add_argument("--sharded", action="store_true", help="FullyShardedStrategy")
parser.add_argument("--ready-dir", default=None, help="meet the other worker here before starting")
args = parser.parse_args()

torch.set_num_threads(1)
if args.ready_dir:
    P.meet(args.ready_dir, os.environ["MW_RANK"], 2)
result: dict = {"rank": int(os.environ.get("MW_RANK", "-1")), "mode": args.mode, "step": None}
started = time.monotonic()
try:
    options = td.CommunicationOptions(timeout_seconds=args.timeout, verify_collectives=not args.off)
    if args.sharded:
        strategy = td.FullyShardedStrategy(communication_options=options)
    else:
        strategy = td.MultiWorkerMirroredStrategy(devices=["cpu:0"], communication_options=options)
    rank = strategy.cluster_resolver.worker_index
    result["rank"] = rank
    torch.manual_seed(H.CHIEF_SEED)
    with strategy.scope():
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaled = args.mode == "skip_scaled_step"
        if scaled:
            optimizer = td.mixed_precision.LossScaleOptimizer(optimizer)
    data = torch.Generator().manual_seed(7)
    strategy.set_loss_scaling_check(False)  # a per-replica mean, knowingly: the job is about mismatches

    def step(x: torch.Tensor, k: int) -> None:
        loss = model(x).square().mean()
        (optimizer.get_scaled_loss(loss) if scaled else loss).backward()
        if args.mode == "extra_forward" and rank == 1 and k == AT:
            model(x).square().mean().backward()
        if not (args.mode in ("skip_step", "skip_scaled_step") and rank == 1 and k == AT):
            optimizer.step()
        if args.mode == "double_step" and rank == 0 and k == AT:
            optimizer.step()
        optimizer.zero_grad()

    for k in range(STEPS):
        result["step"] = k
        if args.mode == "early_end" and rank == 1 and k == AT:
            break
        x = torch.randn(2, 4, generator=data)
        started = time.monotonic()
        if k == AT:
            if args.mode == "extra_reduce" and rank == 1:
                strategy.reduce("sum", torch.ones(3), axis=None)
            elif args.mode == "shape":
                strategy.reduce("sum", torch.ones(4) if rank == 0 else torch.ones(2, 2), axis=None)
            elif args.mode == "dtype":
                strategy.reduce("sum", torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64), axis=None)
            elif args.mode == "gather":
                strategy.gather(torch.ones(2, 3 if rank == 0 else 4), axis=0)
        strategy.run(step, args=(x, k))
    result.update(error=None, finished=True)
    code = 0
except td.DistributeError as error:
    result.update(error=type(error).__name__, message=str(error))
    code = 17
except BaseException as error:  # noqa: BLE001 - any other outcome is reported as wrong
    result.update(error=type(error).__name__, message=str(error))
    code = 18
result["blocked_s"] = time.monotonic() - started
if "model" not in dir():
    result["params"] = None
elif args.sharded:
    whole = code == 0 and args.mode == "none"  # full_tensor() gathers: only when all workers get here
    result["params"] = [v for p in model.parameters()
                        for v in (p.full_tensor() if whole else p.to_local()).detach().reshape(-1).tolist()]
else:
    result["params"] = H.flat(model)
H.emit(result)
sys.stdout.flush()
if code == 0:
    sys.exit(0)  # a normal end: the worker group tells the others this worker finished
os._exit(code)  # no interpreter teardown against a peer in another collective
