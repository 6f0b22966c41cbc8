"""One worker of a job whose rendezvous must check the job secret; prints one ``MWRESULT``.

    python auth_job.py [--sharded] [--timeout S]

Its secret comes from its environment (``TD_JOB_SECRET``). Reports the error it met (a
``JobAuthenticationError`` for a refused worker), the sum of ranks over the job when it
joined, and, on the chief, the addresses its store listens on.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mw_helpers as H  # noqa: E402

import torch_distribute as td  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--sharded", action="store_true")
parser.add_argument("--timeout", type=float, default=20)
args = parser.parse_args()
logging.basicConfig(level=logging.WARNING, format="LOG %(name)s %(levelname)s %(message)s")
rank = int(os.environ["MW_RANK"])


def listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net shows them) of sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:
                    found.append(address)
    return found


options = td.CommunicationOptions(timeout_seconds=args.timeout)
result: dict = {"rank": rank}
try:
    if args.sharded:
        strategy = td.FullyShardedStrategy(communication_options=options)
    else:
        strategy = td.MultiWorkerMirroredStrategy(devices=["cpu:0"], communication_options=options)
    group = strategy.extended.worker_group
    total = strategy.reduce(td.ReduceOp.SUM, strategy.run(lambda: torch.tensor(float(rank + 1))), axis=None)
    result["sum"] = float(total)
    if rank == 0:
        result["listening"] = listening_addresses(group.port)
except Exception as error:  # noqa: BLE001 - reported to the test
    result["error"] = type(error).__name__
    result["message"] = str(error)
    H.emit(result)
    sys.stdout.flush()
    os._exit(0)  # the job never formed: nothing to leave
H.emit(result)
