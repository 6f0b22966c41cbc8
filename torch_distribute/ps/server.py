"""``td.distribute_server()``: what worker and parameter-server tasks run.

TensorFlow's workers and parameter servers run only ``tf.distribute.Server(...).join()``;
the coordinator sends them the work. Here too: a ``worker`` or ``ps`` task joins the RPC
group of the chief and serves until the coordinator shuts the cluster down (or stops
answering for ``chief_timeout`` seconds), then returns.

>>> import torch_distribute as td
>>> td.distribute_server(td.cluster_resolver.SimpleClusterResolver({}))  # not a worker/ps
False
"""

from __future__ import annotations

import sys
import threading
import time

from torch_distribute.cluster import ClusterResolver, resolve_cluster, split_address
from torch_distribute.errors import ClusterConfigError, WorkerUnavailableError
from torch_distribute.ps import transport, worker

__all__ = ["distribute_server"]

_stop = threading.Event()


def stop_server() -> bool:
    """RPC target: the coordinator is done; leave the serving loop."""
    _stop.set()
    return True


def chief_address(resolver: ClusterResolver) -> tuple[str, int]:
    spec = resolver.cluster_spec()
    if "chief" not in spec.jobs or not spec.num_tasks("chief"):
        raise ClusterConfigError(
            "ParameterServerStrategy needs a 'chief' task (the coordinator) in the cluster; "
            f"the cluster has jobs {spec.jobs}."
        )
    first = spec.task_indices("chief")[0]
    return split_address(spec.task_address("chief", first), what="chief address")


def distribute_server(
    cluster_resolver: ClusterResolver | None = None,
    *,
    startup_timeout: float = 120.0,
    rpc_timeout: float = 60.0,
    chief_timeout: float = 20.0,
) -> bool:
    """Serve as this task's ``worker`` or ``ps`` until the coordinator is done.

    Returns ``False`` at once on any other task (the chief, an evaluator, no cluster), so
    every task can run the same script::

        if td.distribute_server():      # a worker or ps task: served, now done
            sys.exit(0)
        strategy = td.ParameterServerStrategy()   # the chief: the coordinator

    Raises:
        WorkerUnavailableError: the chief could not be reached within ``startup_timeout``.
    """
    resolver = cluster_resolver or resolve_cluster()
    spec = resolver.validate()
    task_type, task_id = resolver.task_type, resolver.task_id
    if not spec or task_type not in ("worker", "ps"):
        return False
    address = chief_address(resolver)
    try:
        membership = transport.join(task_type, task_id, address, rpc_timeout=rpc_timeout,
                                    startup_timeout=startup_timeout)
    except Exception as error:
        raise WorkerUnavailableError(
            f"{task_type} {task_id} could not join the coordinator at {address[0]}:{address[1]} "
            f"within {startup_timeout:g} s: {str(error).splitlines()[0] if str(error) else error!r}. "
            "Start the chief task too (every task of TF_CONFIG must run)."
        ) from error
    if task_type == "worker":
        worker.install(worker.WorkerRuntime(task_id, rpc_timeout))
    print(f"[{membership.name}] serving", file=sys.stderr, flush=True)
    _stop.clear()
    last_seen = time.monotonic()
    try:
        while not _stop.wait(2.0):
            if transport.ping(transport.CHIEF, timeout=5.0):
                last_seen = time.monotonic()
            elif time.monotonic() - last_seen > chief_timeout:
                print(f"[{membership.name}] the coordinator stopped answering; exiting",
                      file=sys.stderr, flush=True)
                break
    finally:
        transport.leave()
    return True
