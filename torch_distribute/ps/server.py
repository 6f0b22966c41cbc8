"""``td.distribute_server()``: what worker and parameter-server tasks run.

TensorFlow's workers and parameter servers run only ``tf.distribute.Server(...).join()``;
the coordinator sends them the work. Here too: a ``worker`` or ``ps`` task joins the RPC
group of the chief and serves until the coordinator shuts the cluster down, then returns
``True`` (the script exits 0).

If the chief instead dies (its process is killed, its machine goes away) the job did not
finish, and exiting 0 would look like success. So when the chief stops answering, or closes
the connection, for ``chief_timeout`` seconds, the task prints one line on stderr naming
the chief's address and what happened, and exits with status ``EXIT_CHIEF_LOST`` (1)
(``SystemExit``; with ``exit_on_chief_loss=False``, ``WorkerUnavailableError`` is raised
instead).

>>> import torch_distribute as td
>>> td.distribute_server(td.cluster_resolver.SimpleClusterResolver({}))  # not a worker/ps
False
"""

from __future__ import annotations

import sys
import threading
import time

from torch_distribute.cluster import ClusterResolver, resolve_cluster, split_address
from torch_distribute.errors import (
    ClusterConfigError,
    JobAuthenticationError,
    WorkerUnavailableError,
)
from torch_distribute.ps import transport, worker

__all__ = ["EXIT_CHIEF_LOST", "distribute_server"]

#: The exit status of a worker or ps task whose chief died before shutting the job down.
EXIT_CHIEF_LOST = 1

#: Seconds between two checks that the chief still answers, and each check's deadline.
_CHECK_INTERVAL_S = 1.0
_CHECK_TIMEOUT_S = 5.0

_stop = threading.Event()


def stop_server() -> bool:
    """RPC target: the coordinator is done; leave the serving loop."""
    _stop.set()
    return True


transport.entry_points(stop_server)


def task_addresses(resolver: ClusterResolver) -> dict[str, tuple[str, int]]:
    """``{"worker:0": (host, port), ...}``: where every task of the cluster serves."""
    spec = resolver.cluster_spec()
    return {transport.task_key(job, index): split_address(spec.task_address(job, index), what=f"{job} address")
            for job in spec.jobs for index in spec.task_indices(job)}


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
    exit_on_chief_loss: bool = True,
) -> bool:
    """Serve as this task's ``worker`` or ``ps`` until the coordinator is done.

    Returns ``True`` when the coordinator shut the cluster down, and ``False`` at once on
    any other task (the chief, an evaluator, no cluster), so every task can run the same
    script::

        if td.distribute_server():      # a worker or ps task: served, now done
            sys.exit(0)
        strategy = td.ParameterServerStrategy()   # the chief: the coordinator

    When the chief stops answering (or closes the connection) for ``chief_timeout``
    seconds, the job cannot finish: the task prints one line on stderr,
    ``[worker:0] the chief at HOST:PORT stopped answering ...``, and exits with status
    ``EXIT_CHIEF_LOST`` (it raises ``SystemExit``), so that a cluster manager or the
    launcher sees a failure, not success.

    Raises:
        WorkerUnavailableError: the chief could not be reached within ``startup_timeout``;
            or, with ``exit_on_chief_loss=False``, the chief was lost (same message).
        SystemExit: with status ``EXIT_CHIEF_LOST`` when the chief was lost.
    """
    resolver = cluster_resolver or resolve_cluster()
    spec = resolver.validate()
    task_type, task_id = resolver.task_type, resolver.task_id
    if not spec or task_type not in ("worker", "ps"):
        return False
    assert task_id is not None  # validate() requires it in a non-empty cluster
    address = chief_address(resolver)
    # The first optimizer a task makes imports torch._dynamo (seconds; more on a loaded
    # machine): done before joining, so that no call of the coordinator's waits for it.
    import torch._dynamo  # noqa: F401
    try:
        membership = transport.join(task_type, task_id, address, rpc_timeout=rpc_timeout,
                                    startup_timeout=startup_timeout, addresses=task_addresses(resolver))
    except (ClusterConfigError, JobAuthenticationError):
        raise
    except Exception as error:
        raise WorkerUnavailableError(
            f"{task_type} {task_id} could not join the coordinator at {address[0]}:{address[1]} "
            f"within {startup_timeout:g} s: {str(error).splitlines()[0] if str(error) else error!r}. "
            "Start the chief task too (every task of TF_CONFIG must run)."
        ) from error
    if task_type == "worker":
        worker.install(worker.WorkerRuntime(task_id, rpc_timeout))
    print(f"[{membership.name}] serving", file=sys.stderr, flush=True)
    lost = _serve_until_stopped(f"{address[0]}:{address[1]}", chief_timeout)
    if lost is None:
        return True
    advice = "Restart every task and restore the last checkpoint."
    if not exit_on_chief_loss:
        raise WorkerUnavailableError(f"[{membership.name}] {lost}. {advice}")
    print(f"[{membership.name}] {lost}; exiting with status {EXIT_CHIEF_LOST}. {advice}",
          file=sys.stderr, flush=True)
    raise SystemExit(EXIT_CHIEF_LOST)


def _serve_until_stopped(chief: str, chief_timeout: float) -> str | None:
    """Serve until the coordinator's ``stop_server`` (``None``), or until the chief failed
    every check for ``chief_timeout`` seconds: then one line saying so, naming ``chief``."""
    _stop.clear()
    last_seen = time.monotonic()
    try:
        while not _stop.wait(_CHECK_INTERVAL_S):
            timeout = min(_CHECK_TIMEOUT_S, max(chief_timeout, 0.5))
            reason = transport.probe(transport.CHIEF, timeout=timeout)
            if reason is None or _stop.is_set():  # a shutdown may close the connection
                last_seen = time.monotonic()
                continue
            silent = time.monotonic() - last_seen
            if silent > chief_timeout:
                return (
                    f"the chief at {chief} {reason} and has not answered for {silent:.0f} s "
                    f"(chief_timeout={chief_timeout:g}): the coordinator is gone or hung before "
                    "shutting the job down, which cannot finish without it"
                )
        return None
    finally:
        transport.leave()
