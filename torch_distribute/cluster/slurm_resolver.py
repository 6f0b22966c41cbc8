"""``SlurmClusterResolver``: the cluster of a SLURM job step (TensorFlow's resolver).

It applies (``is_present``) inside a job step started by ``srun``: ``SLURM_PROCID``, a node list
and a step (``SLURM_STEP_ID``; see :mod:`~torch_distribute.cluster.slurm_batch`) are set.
Node lists and tasks-per-node lists are expanded by :mod:`torch_distribute.cluster.slurm`.

>>> env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2",
...        "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
>>> SlurmClusterResolver.is_present(env)
True
>>> r = SlurmClusterResolver(environ=env, gpus_per_node=0)
>>> r.cluster_spec(), r.worker_index
(ClusterSpec({'worker': ['n1:8888', 'n2:8888']}), 1)
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping, MutableMapping

from torch_distribute.cluster.base import ClusterResolver
from torch_distribute.cluster.cluster_spec import ClusterSpec
from torch_distribute.cluster.env import env_int, env_int_value, environ_or_default, first_env
from torch_distribute.cluster.slurm import expand_hostlist, expand_tasks_per_node
from torch_distribute.cluster.slurm_batch import in_srun_step
from torch_distribute.errors import ClusterConfigError

__all__ = ["SlurmClusterResolver"]

#: Where ``SlurmClusterResolver`` remembers ``CUDA_VISIBLE_DEVICES`` as it was before it
#: narrowed it to this task's GPUs, so that building the resolver again is idempotent.
_SLURM_VISIBLE_DEVICES_KEY = "TORCH_DISTRIBUTE_SLURM_VISIBLE_DEVICES"


def _int_argument(value: object, name: str, *, minimum: int = 0) -> int:
    """A constructor argument that must be an integer ``>= minimum``; errors name it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ClusterConfigError(f"{name} must be an integer, got {type(value).__name__}: {value!r}")
    if value < minimum:
        raise ClusterConfigError(f"{name} must be at least {minimum}, got {value}")
    return value


def _visible_devices(environ: Mapping[str, str]) -> list[str] | None:
    """The node's visible GPU ids before any narrowing, or ``None`` when not restricted."""
    value = environ.get(_SLURM_VISIBLE_DEVICES_KEY)
    if value is None:
        value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [item.strip() for item in value.split(",") if item.strip()]


def _count_node_gpus(environ: Mapping[str, str]) -> int:
    """GPUs on this node: ``CUDA_VISIBLE_DEVICES``, ``SLURM_GPUS_ON_NODE``, else nvidia-smi.

    Deliberately does not ask torch, which would initialise CUDA before
    ``CUDA_VISIBLE_DEVICES`` is narrowed.
    """
    visible = _visible_devices(environ)
    if visible is not None:
        return len(visible)
    on_node = environ.get("SLURM_GPUS_ON_NODE")
    if on_node is not None and on_node.strip():
        return env_int(environ, "SLURM_GPUS_ON_NODE", minimum=0)
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return 0
    try:
        output = subprocess.run(
            [nvidia_smi, "--list-gpus"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in output.splitlines())


class SlurmClusterResolver(ClusterResolver):
    """Builds the cluster of a SLURM job step (TensorFlow's ``SlurmClusterResolver``).

    Reads ``SLURM_PROCID`` (this task's rank), the step's node list
    (``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``), the tasks on each node
    (``SLURM_STEP_TASKS_PER_NODE``, else ``SLURM_TASKS_PER_NODE``, e.g. ``"2(x3),1"``)
    and the number of tasks (``SLURM_STEP_NUM_TASKS``, else ``SLURM_NTASKS``).

    Tasks are laid out as SLURM's default block distribution places them: node by node in
    node-list order, ``tasks_per_node`` consecutive ranks on each node; the ``k``-th task
    on node ``h`` has address ``h:{port_base + k}``. The ranks are then handed to the jobs
    in the order of ``jobs`` (default ``{"worker": number of tasks}``), which gives this
    task's ``task_type`` and ``task_id``.

    GPUs: with ``gpus_per_node`` GPUs on a node (default: counted from
    ``CUDA_VISIBLE_DEVICES``, ``SLURM_GPUS_ON_NODE`` or ``nvidia-smi``) each task gets
    ``gpus_per_task`` of them (default: an even share); with ``auto_set_gpu`` the
    resolver sets ``CUDA_VISIBLE_DEVICES`` in ``environ`` to this task's share, which only
    works before CUDA is initialised in the process.

    Args:
        jobs: ``{job_name: number_of_tasks}``, in rank order.
        port_base: the port of the first task on each node.
        gpus_per_node, gpus_per_task: see above.
        tasks_per_node: an int for every node, or ``{host: n}``; default from SLURM.
        auto_set_gpu: narrow ``CUDA_VISIBLE_DEVICES`` to this task's GPUs.
        rpc_layer: the ``master()`` protocol prefix.
        environ: where the variables are read (and ``CUDA_VISIBLE_DEVICES`` written, if it
            is mutable); default ``os.environ``.

    Raises:
        ClusterConfigError: a missing or malformed variable (named), more tasks requested
            than the step has, or more GPUs per node than there are.

    >>> env = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4",
    ...        "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    >>> r = SlurmClusterResolver(environ=env, gpus_per_node=0)
    >>> r.cluster_spec()
    ClusterSpec({'worker': ['n1:8888', 'n1:8889', 'n2:8888', 'n2:8889']})
    >>> r.task_type, r.task_id, r.local_rank, r.rendezvous_address()
    ('worker', 3, 1, ('n1', 8888))
    """

    def __init__(
        self,
        jobs: Mapping[str, int] | None = None,
        port_base: int = 8888,
        gpus_per_node: int | None = None,
        gpus_per_task: int | None = None,
        tasks_per_node: int | Mapping[str, int] | None = None,
        auto_set_gpu: bool = True,
        rpc_layer: str | None = "grpc",
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(rpc_layer=rpc_layer, environ=environ)
        env = self.environ
        hint = " (SLURM sets it inside a job step: start the workers with srun)"
        self._rank = env_int(env, "SLURM_PROCID", minimum=0, hint=hint)
        self._port_base = _int_argument(port_base, "port_base", minimum=1)

        configuration = self._task_configuration(tasks_per_node)
        self._hosts = list(configuration)
        total = sum(configuration.values())
        if total == 0:
            raise ClusterConfigError("the SLURM step has no tasks on any node")
        last_port = self._port_base + max(configuration.values()) - 1
        if last_port > 65535:
            raise ClusterConfigError(
                f"port_base={self._port_base} with up to {max(configuration.values())} tasks on "
                f"a node gives ports up to {last_port}, past 65535; pass a lower port_base"
            )

        num_tasks = first_env(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        if jobs is None:
            count = total if num_tasks is None else env_int_value(*num_tasks)
            if count != total:
                name, text = num_tasks  # type: ignore[misc]
                raise ClusterConfigError(
                    f"{name}={text!r} but the SLURM step places {total} tasks on its nodes "
                    f"({configuration}); the SLURM variables disagree (or pass jobs=)"
                )
            jobs = {"worker": count}
        if not isinstance(jobs, Mapping):
            raise ClusterConfigError(
                f"jobs must be a dict of job name -> number of tasks, got {jobs!r}"
            )
        for job, n in jobs.items():
            if not isinstance(job, str) or not job:
                raise ClusterConfigError(f"jobs has a job name {job!r}; job names are strings")
            _int_argument(n, f"jobs[{job!r}]")
        self._jobs = dict(jobs)
        requested = sum(self._jobs.values())
        if requested != total:
            raise ClusterConfigError(
                f"jobs {self._jobs} ask for {requested} tasks but the SLURM step places "
                f"{total} tasks on its nodes ({configuration})"
            )
        if self._rank >= total:
            raise ClusterConfigError(
                f"SLURM_PROCID={self._rank} is not below the number of tasks, {total}"
            )

        # Block distribution: node by node, consecutive local indices.
        self._addresses: list[str] = []
        self._local_index: list[int] = []
        for host, count in configuration.items():
            for local in range(count):
                self._addresses.append(f"{host}:{self._port_base + local}")
                self._local_index.append(local)

        start = 0
        self._slurm_task_type: str | None = None
        self._slurm_task_id: int | None = None
        for job, count in self._jobs.items():
            if start <= self._rank < start + count:
                self._slurm_task_type, self._slurm_task_id = job, self._rank - start
            start += count

        max_tasks = max(configuration.values())
        if gpus_per_node is None:
            gpus_per_node = _count_node_gpus(env)
        gpus_per_node = _int_argument(gpus_per_node, "gpus_per_node")
        if gpus_per_task is None:
            gpus_per_task = gpus_per_node // max_tasks
        gpus_per_task = _int_argument(gpus_per_task, "gpus_per_task")
        if max_tasks * gpus_per_task > gpus_per_node:
            raise ClusterConfigError(
                f"asked for {gpus_per_task} GPUs per task with up to {max_tasks} tasks on a "
                f"node, but a node has only {gpus_per_node} GPUs"
            )
        self._gpus_per_node = gpus_per_node
        self._gpus_per_task = gpus_per_task
        if auto_set_gpu and gpus_per_task > 0:
            self._set_visible_devices()

    def _task_configuration(self, tasks_per_node: int | Mapping[str, int] | None) -> dict[str, int]:
        env = self.environ
        if isinstance(tasks_per_node, Mapping):
            return {str(host): _int_argument(n, f"tasks_per_node[{host!r}]")
                    for host, n in tasks_per_node.items()}
        found = first_env(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        if found is None:
            raise ClusterConfigError(
                "environment variable SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST) is not set "
                "(SLURM sets it inside a job step: start the workers with srun)"
            )
        nodelist = found[1]
        hosts = expand_hostlist(nodelist)
        if len(set(hosts)) != len(hosts):
            raise ClusterConfigError(f"SLURM node list {nodelist!r} names a node twice")
        if tasks_per_node is not None:
            return dict.fromkeys(hosts, _int_argument(tasks_per_node, "tasks_per_node", minimum=1))
        found = first_env(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
        if found is not None:
            name, text = found
            counts = expand_tasks_per_node(text)
            if len(counts) != len(hosts):
                raise ClusterConfigError(
                    f"{name}={text!r} gives {len(counts)} nodes but the node list "
                    f"{nodelist!r} has {len(hosts)}"
                )
            return dict(zip(hosts, counts, strict=True))
        per_node = first_env(env, "SLURM_NTASKS_PER_NODE")
        if per_node is not None:
            return dict.fromkeys(hosts, env_int(env, per_node[0], minimum=1))
        num_tasks = first_env(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        if num_tasks is not None and env_int_value(*num_tasks) % len(hosts) == 0:
            return dict.fromkeys(hosts, env_int_value(*num_tasks) // len(hosts))
        raise ClusterConfigError(
            "cannot tell how many tasks run on each node: set SLURM_STEP_TASKS_PER_NODE "
            "(srun does) or pass tasks_per_node="
        )

    def _gpu_ids(self, local_index: int) -> list[str]:
        visible = _visible_devices(self.environ)
        first = local_index * self._gpus_per_task
        ids = range(first, first + self._gpus_per_task)
        if visible is not None and len(visible) >= first + self._gpus_per_task:
            return [visible[i] for i in ids]
        return [str(i) for i in ids]

    def _set_visible_devices(self) -> None:
        env = self.environ
        if not isinstance(env, MutableMapping):
            return
        ids = ",".join(self._gpu_ids(self._local_index[self._rank]))
        if _SLURM_VISIBLE_DEVICES_KEY not in env:
            env[_SLURM_VISIBLE_DEVICES_KEY] = env.get("CUDA_VISIBLE_DEVICES", "")
        env["CUDA_VISIBLE_DEVICES"] = ids

    @classmethod
    def is_present(cls, environ: Mapping[str, str] | None = None) -> bool:
        """True when ``SLURM_PROCID`` and a node list are set (inside a SLURM step)."""
        env = environ_or_default(environ)
        nodelist = first_env(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        return bool(env.get("SLURM_PROCID")) and nodelist is not None and in_srun_step(env)

    def cluster_spec(self) -> ClusterSpec:
        cluster: dict[str, list[str]] = {}
        start = 0
        for job, count in self._jobs.items():
            if count:
                cluster[job] = self._addresses[start : start + count]
            start += count
        return ClusterSpec(cluster)

    def _default_task_type(self) -> str | None:
        return self._slurm_task_type

    def _default_task_id(self) -> int | None:
        return self._slurm_task_id

    def get_task_info(self) -> tuple[str | None, int | None]:
        """``(task_type, task_id)`` of this process (TensorFlow's name for it)."""
        return self.task_type, self.task_id

    @property
    def local_rank(self) -> int:
        """This task's index among the tasks on its node."""
        return self._local_index[self._rank]

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None
    ) -> dict[str, int]:
        """``{"GPU": gpus_per_task}``, or ``{}`` without GPUs."""
        del task_type, task_id
        return {"GPU": self._gpus_per_task} if self._gpus_per_task > 0 else {}
