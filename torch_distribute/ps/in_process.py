"""``td.ps.create_in_process_cluster``: the tutorial's single-program form.

TensorFlow's parameter-server tutorial starts its workers and parameter servers from the
coordinator's own program (``create_in_process_cluster``), so that one script or notebook
runs the whole job. Here the worker and ps tasks are child processes of the coordinator,
each running only the serving loop (``python -m torch_distribute.ps.serve_task``, which calls
``td.distribute_server()``), never the user's script: scheduled functions reach them by value
(``cloudpickle``, see :mod:`torch_distribute.ps.pickling`).

The children belong to the coordinator. They leave when it shuts the cluster down (the end
of the program) and are stopped at exit, whatever the exit: a normal end or an exception
(``atexit``: SIGTERM, then SIGKILL, to each child's process group, by
:class:`~torch_distribute.cluster.supervisor.ProcessSupervisor`); a coordinator killed by a
signal, SIGKILL included, takes them with it (Linux ``PR_SET_PDEATHSIG``, and on every
system each child checks about twice a second that its parent still lives).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import IO

from torch_distribute.cluster import SimpleClusterResolver
from torch_distribute.cluster.launch_spec import free_ports
from torch_distribute.cluster.supervisor import ProcessSupervisor, TaskSpec
from torch_distribute.collectives import job_secret
from torch_distribute.errors import InvalidArgumentError

__all__ = ["InProcessCluster", "create_in_process_cluster"]

#: Seconds the children get to leave on their own at exit (after the coordinator's shutdown).
EXIT_WAIT_S = 5.0
#: Seconds between SIGTERM and SIGKILL when they did not.
GRACE_PERIOD_S = 3.0
#: How long a child waits for the coordinator to create its ``ParameterServerStrategy``.
STARTUP_TIMEOUT_S = 24 * 3600.0

#: The module the children run.
SERVER_MODULE = "torch_distribute.ps.serve_task"


class InProcessCluster:
    """The worker and ps child processes of one ``create_in_process_cluster`` call."""

    def __init__(self, cluster: dict[str, list[str]], supervisor: ProcessSupervisor):
        self.cluster = cluster
        self._supervisor = supervisor
        self._closed = False
        self._lock = threading.Lock()

    @property
    def pids(self) -> list[int]:
        """The process ids of the children (workers first, then parameter servers)."""
        return [process.pid for process in self._supervisor.processes]

    def close(self, wait: float = EXIT_WAIT_S) -> None:
        """Wait up to ``wait`` seconds for the children to leave, then stop what is left."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        end = time.monotonic() + wait
        for process in self._supervisor.processes:
            try:
                process.proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        self._supervisor.stop_all()


_clusters: list[InProcessCluster] = []


def _child_path() -> str:
    """The coordinator's import path for the children, so they import the same modules."""
    system = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    entries = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
    entries = [p for p in entries if not p.startswith(system)]
    return os.pathsep.join(dict.fromkeys(entries))


def create_in_process_cluster(
    num_workers: int,
    num_ps: int,
    *,
    extra_env: Mapping[str, str] | None = None,
    output: IO[str] | None = None,
) -> SimpleClusterResolver:
    """Start ``num_workers`` workers and ``num_ps`` parameter servers as children of this
    process (the coordinator); return the resolver for ``td.ParameterServerStrategy``.

    The job gets a secret (``TD_JOB_SECRET``, unless this process has one already), set in
    this process's environment and the children's. The children serve on loopback and run no user code but the functions scheduled on them
    (sent by value); they use this process's ``sys.path`` to import modules by name. They end
    with this process however it ends. Their output lines go to ``output`` (default: this
    process's stderr) prefixed ``[worker:0] ``, ``[ps:0] ``.

    Example (TensorFlow's tutorial, one program)::

        cluster_resolver = td.ps.create_in_process_cluster(num_workers=2, num_ps=1)
        strategy = td.ParameterServerStrategy(cluster_resolver)
        coordinator = td.coordinator.ClusterCoordinator(strategy)

    Args:
        num_workers, num_ps: how many of each (at least one).
        extra_env: environment variables for the children, over this process's own.
        output: where the children's stdout and stderr lines go.

    The children are fresh interpreters (``TD_START_METHOD`` does not apply: a forkserver
    would first import this program's main module in each child, which the single-program
    form does not guard).

    Raises:
        InvalidArgumentError: ``num_workers`` or ``num_ps`` is not a positive integer.
    """
    for name, value in (("num_workers", num_workers), ("num_ps", num_ps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"create_in_process_cluster: {name} must be a positive integer, got {value!r}")
    ports = free_ports(1 + num_workers + num_ps)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    cluster = {"chief": addresses[:1], "worker": addresses[1:1 + num_workers], "ps": addresses[1 + num_workers:]}
    # The job's secret (docs/security.md): the user's, or a fresh one, which this process (the
    # coordinator) keeps in its own environment for the strategy it creates next.
    if job_secret.job_secret() is None:
        os.environ[job_secret.ENV_SECRET] = job_secret.new_secret()
    base = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    base.setdefault("OMP_NUM_THREADS", "1")
    base["PYTHONPATH"] = _child_path()
    command = [sys.executable, "-u", "-m", SERVER_MODULE, "--parent", str(os.getpid()),
               "--startup-timeout", str(STARTUP_TIMEOUT_S)]
    if threading.current_thread() is threading.main_thread():
        # PR_SET_PDEATHSIG fires when the *thread* that started the child ends: only the
        # main thread lives as long as the process.
        command.append("--pdeathsig")

    def task(job: str, index: int) -> TaskSpec:
        config = {"cluster": cluster, "task": {"type": job, "index": index}}
        return TaskSpec(name=f"{job}:{index}", prefix=f"[{job}:{index}] ", command=command,
                        env={**base, "TF_CONFIG": json.dumps(config)})

    stream = output if output is not None else sys.stderr
    supervisor = ProcessSupervisor(stdout=stream, stderr=stream, grace_period=GRACE_PERIOD_S,
                                   log_prefix="[in_process_cluster] ", log_stream=stream,
                                   start_method="fresh")
    in_process = InProcessCluster(cluster, supervisor)
    try:
        supervisor.start_all([task("worker", i) for i in range(num_workers)]
                             + [task("ps", i) for i in range(num_ps)])
    except BaseException:
        supervisor.kill_all()
        raise
    _clusters.append(in_process)
    # Registered before the strategy's own shutdown (atexit runs last-in first-out), so the
    # children are told to leave first and stopped only if they did not.
    atexit.register(in_process.close)
    return SimpleClusterResolver(cluster, task_type="chief", task_id=0)
