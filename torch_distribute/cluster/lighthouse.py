"""torchft's lighthouse: the quorum server of a fault-tolerant job, as a process of its own.

``torch-distribute launch --min-workers N`` runs one in its own process, next to the
workers (on 127.0.0.1 for a job on one machine; on ``--master``'s host, by node 0's launcher,
for a job across machines: ``start_lighthouse``), and gives every worker its address in
``TD_FT_LIGHTHOUSE``. On a cluster where something else starts
the workers (SLURM, Kubernetes, torchrun), start one yourself where every worker reaches it::

    torch-distribute lighthouse --min-workers 2 --bind 0.0.0.0:29510
    # then, for every worker: TD_FT_LIGHTHOUSE=http://<that host>:29510

It keeps no training state: it only tells the live workers who is in each step's quorum
(``collectives/fault_tolerant_group.py``). Its timeouts:

- ``heartbeat_timeout``: a worker silent this long (killed, stopped, cut off) leaves the
  quorums; the survivors' next quorum waits at most this long for it.
- ``join_timeout``: a worker that is starting (its heartbeats arrive, its first quorum
  request has not) is waited for this long by a quorum that lost a member.

>>> DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_JOIN_TIMEOUT
(2.0, 3.0)
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from typing import Any

from torch_distribute.collectives.fault_tolerant_group import require_torchft
from torch_distribute.errors import FaultToleranceError

__all__ = ["DEFAULT_HEARTBEAT_TIMEOUT", "DEFAULT_JOIN_TIMEOUT", "main", "serve", "start_lighthouse"]

DEFAULT_HEARTBEAT_TIMEOUT = 2.0
DEFAULT_JOIN_TIMEOUT = 3.0


def start_lighthouse(bind: str, min_workers: int, join_timeout: float = DEFAULT_JOIN_TIMEOUT,
                     heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT) -> Any:
    """A lighthouse serving at ``bind`` from this process's threads (torchft's
    ``LighthouseServer``: ``shutdown()`` it); ``FaultToleranceError`` without torchft."""
    require_torchft()
    from torchft._torchft import LighthouseServer

    return LighthouseServer(bind=bind, min_replicas=min_workers, join_timeout_ms=int(join_timeout * 1000),
                            quorum_tick_ms=50, heartbeat_timeout_ms=int(heartbeat_timeout * 1000))


def serve(bind: str, min_workers: int, join_timeout: float = DEFAULT_JOIN_TIMEOUT,
          heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT) -> int:
    """Run a lighthouse until SIGINT or SIGTERM; prints its address first."""
    ending = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, ending)  # the server's threads inherit the mask
    try:
        server = start_lighthouse(bind, min_workers, join_timeout, heartbeat_timeout)
    except FaultToleranceError as error:
        print(f"torch-distribute lighthouse: {error}", file=sys.stderr)
        return 2
    print(f"torch-distribute lighthouse: listening at {bind} (min_workers={min_workers})", flush=True)
    try:
        signal.sigwait(ending)
    finally:
        server.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``torch-distribute lighthouse``: parse ``argv`` and serve."""
    parser = argparse.ArgumentParser(
        prog="torch-distribute lighthouse",
        description="Run torchft's lighthouse, the quorum server of a fault-tolerant job "
                    "(td.experimental.FaultTolerance). Give every worker its address in TD_FT_LIGHTHOUSE.")
    parser.add_argument("--bind", default="0.0.0.0:29510", metavar="HOST:PORT",
                        help="where to listen (default 0.0.0.0:29510)")
    parser.add_argument("--min-workers", type=int, required=True, metavar="N",
                        help="the fewest live workers a step may run with (FaultTolerance's min_workers)")
    parser.add_argument("--join-timeout", type=float, default=DEFAULT_JOIN_TIMEOUT, metavar="S",
                        help=f"seconds a quorum waits for a starting worker (default {DEFAULT_JOIN_TIMEOUT:g})")
    parser.add_argument("--heartbeat-timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT, metavar="S",
                        help=f"seconds of silence after which a worker leaves the quorums (default "
                             f"{DEFAULT_HEARTBEAT_TIMEOUT:g})")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.min_workers < 1:
        parser.error("--min-workers must be >= 1")
    return serve(args.bind, args.min_workers, args.join_timeout, args.heartbeat_timeout)


if __name__ == "__main__":
    sys.exit(main())
