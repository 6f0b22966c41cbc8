"""One worker or ps task of ``td.ps.create_in_process_cluster``: serve, and die with the parent.

    python -m torch_distribute.ps.serve_task --parent PID [--pdeathsig] [--startup-timeout S]

The task's place comes from ``TF_CONFIG``; it runs ``td.distribute_server()`` and nothing of
the user's program. It ends when the coordinator shuts the cluster down (status 0), and at
once when its parent process ``PID`` is gone, however it went: Linux's ``PR_SET_PDEATHSIG``
(``--pdeathsig``; SIGKILL when the parent thread ends) and a thread that checks
``os.getppid()`` twice a second (every system).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

from torch_distribute.ps.server import distribute_server

__all__ = ["main"]

_PR_SET_PDEATHSIG = 1
_CHECK_S = 0.5


def _end_now() -> None:
    """End this process at once, as PR_SET_PDEATHSIG would (no cleanup: the job is gone)."""
    os.kill(os.getpid(), signal.SIGKILL)


def _die_with(coordinator: int, pdeathsig: bool) -> None:
    parent = os.getppid()
    if parent != coordinator:  # adopted by another process already: the coordinator is gone
        _end_now()
    if pdeathsig and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watching thread below still applies
    if os.getppid() != parent:  # it died before prctl: nothing would tell us
        _end_now()

    def watch() -> None:
        while True:
            time.sleep(_CHECK_S)
            if os.getppid() != parent:
                _end_now()

    threading.Thread(target=watch, name="td-watch-parent", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name if __spec__ else 'serve_task'}")
    parser.add_argument("--parent", type=int, required=True, help="the coordinator's process id")
    parser.add_argument("--pdeathsig", action="store_true", help="Linux: SIGKILL when the parent dies")
    parser.add_argument("--startup-timeout", type=float, default=3600.0)
    args = parser.parse_args(argv)
    _die_with(args.parent, args.pdeathsig)
    if not distribute_server(startup_timeout=args.startup_timeout):
        print("serve_task: TF_CONFIG names no worker or ps task", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
