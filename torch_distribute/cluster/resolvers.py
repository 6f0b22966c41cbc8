"""Cluster resolvers: where a worker learns the cluster it belongs to and its place in it.

The API follows ``tf.distribute.cluster_resolver``: every resolver has ``cluster_spec()``,
``task_type``, ``task_id``, ``rpc_layer``, ``environment`` and ``num_accelerators()``.
On top of it, every resolver answers what ``MultiWorkerMirroredStrategy`` needs to form a
``torch.distributed`` process group: ``num_workers`` (the world size), ``worker_index``
(the rank, TensorFlow's ``id_in_cluster``), ``is_chief``, ``rendezvous_address()`` (the
c10d store's host and port) and ``local_rank``.

Where the description comes from:

- ``TFConfigClusterResolver``: the ``TF_CONFIG`` environment variable, exactly as TensorFlow
  reads it, with TensorFlow's validation (``validate_cluster_spec``).
- ``TorchrunClusterResolver``: torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``.
- ``SlurmClusterResolver``: ``SLURM_PROCID``, the step's node list and tasks per node.
- ``SimpleClusterResolver``: given values.

``resolve_cluster()`` picks the first that applies, in that order, else a single local
worker.

>>> import json
>>> env = {"TF_CONFIG": json.dumps({
...     "cluster": {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"]},
...     "task": {"type": "worker", "index": 1}})}
>>> resolver = resolve_cluster(env)
>>> type(resolver).__name__, resolver.num_workers, resolver.worker_index, resolver.is_chief
('TFConfigClusterResolver', 3, 2, False)
>>> resolver.rendezvous_address()
('c', 2222)
"""

from __future__ import annotations

import abc
import json
import os
import shutil
import subprocess
from collections.abc import Mapping, MutableMapping

import torch

from torch_distribute.cluster.cluster_spec import ClusterSpec, ClusterSpecLike, split_address
from torch_distribute.cluster.slurm import expand_hostlist, expand_tasks_per_node
from torch_distribute.errors import ClusterConfigError

__all__ = [
    "VALID_TASK_TYPES",
    "ClusterResolver",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TorchrunClusterResolver",
    "resolve_cluster",
    "validate_cluster_spec",
]

#: The job names a multi-worker cluster may have, as in TensorFlow.
VALID_TASK_TYPES = ("chief", "worker", "evaluator", "ps")

#: ``rendezvous_address()`` of a single local worker: nobody else has to find it, so any
#: free port will do (port 0).
_LOCAL_RENDEZVOUS = ("127.0.0.1", 0)

_TF_CONFIG = "TF_CONFIG"


def _quoted(names: tuple[str, ...] | list[str]) -> str:
    return ", ".join(repr(n) for n in names)


def _coerce_index(value: object, field: str) -> int | None:
    """A task index: ``None``, an ``int`` or a string of digits (``"1"``)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ClusterConfigError(f"{field} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ClusterConfigError(f"{field} must be an integer, got {value!r}")


def validate_cluster_spec(
    cluster_spec: ClusterSpecLike, task_type: str | None, task_id: int | None
) -> None:
    """Check a multi-worker cluster and this task's place in it (TensorFlow's rules).

    An empty cluster is a single local worker and always valid. Otherwise:

    - every job is one of ``chief``, ``worker``, ``evaluator``, ``ps``;
    - at most one ``chief`` task and at most one ``evaluator`` task;
    - no address is used by two tasks;
    - ``task_type`` and ``task_id`` are both given (``task`` in ``TF_CONFIG``);
    - ``task_type`` is a valid job name and a job of the cluster (an ``evaluator`` may be
      missing from the cluster: it runs on its own);
    - ``task_id`` is an integer index of a task of that job.

    Raises:
        ClusterConfigError: naming the field to fix (``cluster``, ``task.type``,
            ``task.index``).

    >>> validate_cluster_spec({"worker": ["a:1", "b:1"]}, "worker", 1)
    >>> validate_cluster_spec({"worker": ["a:1", "b:1"]}, "worker", 2)
    Traceback (most recent call last):
    ...
    torch_distribute.errors.ClusterConfigError: task.index 2 is past the end of job 'worker', which has 2 tasks (valid indices are 0..1)
    """
    spec = ClusterSpec(cluster_spec)
    if not spec:
        return
    jobs = spec.jobs
    for job in jobs:
        if job not in VALID_TASK_TYPES:
            hint = " (TensorFlow 1's 'master' is called 'chief' here)" if job == "master" else ""
            raise ClusterConfigError(
                f"cluster has an unknown job {job!r}{hint}; job names must be among "
                f"{_quoted(VALID_TASK_TYPES)}"
            )
    for job in ("chief", "evaluator"):
        if job in jobs and spec.num_tasks(job) > 1:
            raise ClusterConfigError(
                f"cluster job {job!r} has {spec.num_tasks(job)} tasks; there must be at most "
                f"one {job!r} task"
            )
    owners: dict[str, tuple[str, int]] = {}
    for job in jobs:
        for index in spec.task_indices(job):
            address = spec.task_address(job, index)
            if address in owners:
                other_job, other_index = owners[address]
                raise ClusterConfigError(
                    f"cluster address {address!r} is used by two tasks, {other_job} "
                    f"{other_index} and {job} {index}; every task needs its own host:port"
                )
            owners[address] = (job, index)

    if task_type is None and task_id is None:
        raise ClusterConfigError(
            "a cluster is given but not which task this process is: set `task` in TF_CONFIG, "
            'e.g. "task": {"type": "worker", "index": 0} (or pass task_type= and task_id= '
            "to the cluster resolver)"
        )
    if task_type is None:
        raise ClusterConfigError(
            f"task.type is missing (task.index is {task_id!r}): set `task.type` in TF_CONFIG "
            f"to one of {_quoted(jobs)}"
        )
    if task_id is None:
        raise ClusterConfigError(
            f"task.index is missing (task.type is {task_type!r}): set `task.index` in TF_CONFIG"
        )
    if task_type not in VALID_TASK_TYPES:
        raise ClusterConfigError(
            f"task.type {task_type!r} is not a valid task type; it must be one of "
            f"{_quoted(VALID_TASK_TYPES)}"
        )
    if task_type not in jobs and task_type != "evaluator":
        raise ClusterConfigError(
            f"task.type {task_type!r} is not a job of the cluster, whose jobs are {_quoted(jobs)}"
        )
    if isinstance(task_id, bool) or not isinstance(task_id, int):
        raise ClusterConfigError(f"task.index must be an integer, got {task_id!r}")
    if task_id < 0:
        raise ClusterConfigError(f"task.index {task_id} is negative")
    if task_type in jobs:
        indices = spec.task_indices(task_type)
        count = len(indices)
        if indices == list(range(count)):
            if task_id >= count:
                last = f"valid indices are 0..{count - 1}" if count else "it has no tasks"
                raise ClusterConfigError(
                    f"task.index {task_id} is past the end of job {task_type!r}, which has "
                    f"{count} task{'' if count == 1 else 's'} ({last})"
                )
        elif task_id not in indices:
            raise ClusterConfigError(
                f"task.index {task_id} is not a task of job {task_type!r}, whose task indices "
                f"are {indices}"
            )


class ClusterResolver(abc.ABC):
    """Base class: the cluster, this task's place in it, and the derived rendezvous facts.

    Subclasses implement ``cluster_spec()`` and may supply defaults for ``task_type`` /
    ``task_id`` / ``rpc_layer``; values set on the properties override them (as in
    TensorFlow).

    ``environ`` (every resolver takes it, default ``os.environ``) is where environment
    variables are read from, so a resolver can be built from a plain dict.

    >>> r = SimpleClusterResolver({"worker": ["a:1", "b:1"]}, task_type="worker", task_id=0)
    >>> r.num_workers, r.worker_index, r.is_chief, r.rendezvous_address()
    (2, 0, True, ('a', 1))
    """

    def __init__(
        self,
        *,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        self._environ: Mapping[str, str] = os.environ if environ is None else environ

    # -- TensorFlow's ClusterResolver API -----------------------------------------------

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """The current cluster (an empty ``ClusterSpec`` means a single local worker)."""

    def _default_task_type(self) -> str | None:
        return None

    def _default_task_id(self) -> int | None:
        return None

    def _default_rpc_layer(self) -> str | None:
        return None

    @property
    def task_type(self) -> str | None:
        """This task's job name (``"chief"``, ``"worker"``, ...), or ``None`` if unknown."""
        if self._task_type is not None:
            return str(self._task_type)
        return self._default_task_type()

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        """This task's index within its job, or ``None`` if unknown."""
        if self._task_id is not None:
            return _coerce_index(self._task_id, "task_id")
        return self._default_task_id()

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:
        """The protocol prefix of ``master()`` (``"grpc"`` in TensorFlow; informational here)."""
        if self._rpc_layer is not None:
            return self._rpc_layer
        return self._default_rpc_layer()

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> str:
        """The environment the job runs in (``""``: an ordinary cluster)."""
        return ""

    @property
    def environ(self) -> Mapping[str, str]:
        """The mapping environment variables are read from (``os.environ`` by default)."""
        return self._environ

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None
    ) -> dict[str, int]:
        """Accelerators per task: ``{"GPU": n}`` with the visible CUDA devices, else ``{}``.

        >>> SimpleClusterResolver({}, num_accelerators={"GPU": 2}).num_accelerators()
        {'GPU': 2}
        """
        del task_type, task_id  # every task is assumed to look like this one
        count = torch.cuda.device_count()
        return {"GPU": count} if count > 0 else {}

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """``rpc_layer://address`` of a task (this one by default); ``""`` when unknown."""
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        spec = self.cluster_spec()
        if not spec or task_type is None or task_id is None or task_type not in spec.jobs:
            return ""
        address = spec.task_address(task_type, task_id)
        rpc_layer = self.rpc_layer if rpc_layer is None else rpc_layer
        return f"{rpc_layer}://{address}" if rpc_layer else address

    # -- what the multi-worker strategy needs --------------------------------------------

    def validate(self) -> ClusterSpec:
        """Check the cluster and this task's place in it; return the cluster.

        Raises:
            ClusterConfigError: see ``validate_cluster_spec``.
        """
        spec = self.cluster_spec()
        if spec:
            validate_cluster_spec(spec, self.task_type, self.task_id)
        return spec

    @property
    def num_workers(self) -> int:
        """Workers taking part in training: chief + workers (1 for a lone evaluator).

        An empty cluster is one local worker.
        """
        spec = self.validate()
        if not spec:
            return 1
        task_type = self.task_type
        if task_type == "evaluator":
            return 1
        if task_type not in ("chief", "worker"):
            raise ClusterConfigError(
                f"task.type {task_type!r} is not a training worker; only 'chief', 'worker' "
                "and 'evaluator' tasks run a multi-worker strategy"
            )
        jobs = spec.jobs
        count = sum(spec.num_tasks(job) for job in ("chief", "worker") if job in jobs)
        if count == 0:
            raise ClusterConfigError("cluster has no 'chief' or 'worker' task")
        return count

    @property
    def worker_index(self) -> int:
        """This worker's rank in ``[0, num_workers)``: TensorFlow's ``id_in_cluster``.

        The chief is 0; worker ``i`` is ``i + (number of chief tasks)``; an evaluator is
        its own index.
        """
        spec = self.validate()
        if not spec:
            return 0
        task_type, task_id = self.task_type, self.task_id
        assert task_id is not None  # validated
        if task_type == "chief":
            return 0
        if task_type == "worker":
            return task_id + (spec.num_tasks("chief") if "chief" in spec.jobs else 0)
        if task_type == "evaluator":
            return task_id
        raise ClusterConfigError(
            f"task.type {task_type!r} has no worker index; only 'chief', 'worker' and "
            "'evaluator' tasks do"
        )

    @property
    def is_chief(self) -> bool:
        """TensorFlow's rule: the chief task, an evaluator, or worker 0 when there is no chief.

        The chief is the worker that writes checkpoints and summaries.
        """
        spec = self.validate()
        if not spec:
            return True
        task_type = self.task_type
        if task_type in ("chief", "evaluator"):
            return True
        return task_type == "worker" and "chief" not in spec.jobs and self.task_id == 0

    def rendezvous_address(self) -> tuple[str, int]:
        """``(host, port)`` where all workers meet: the chief's address, else worker 0's.

        For a single local worker (empty cluster) this is ``("127.0.0.1", 0)``: nobody has to
        find it, so any free port will do. A lone evaluator meets at its own address.
        """
        spec = self.validate()
        if not spec:
            return _LOCAL_RENDEZVOUS
        jobs = spec.jobs
        if self.task_type == "evaluator":
            if "evaluator" not in jobs:
                return _LOCAL_RENDEZVOUS
            job = "evaluator"
        elif "chief" in jobs and spec.num_tasks("chief"):
            job = "chief"
        else:
            job = "worker"
        first = spec.task_indices(job)[0] if job in jobs and spec.num_tasks(job) else None
        if first is None:
            raise ClusterConfigError(f"cluster has no {job!r} task to rendezvous at")
        if job == "worker" and first != 0:
            raise ClusterConfigError(
                f"cluster lists no worker 0 (its worker indices are {spec.task_indices(job)}), "
                "so there is no address to rendezvous at; list worker 0 or add a 'chief'"
            )
        return split_address(spec.task_address(job, first), what=f"address of {job} {first}")

    @property
    def local_rank(self) -> int:
        """This process's index among the workers on its machine (``LOCAL_RANK``, else 0)."""
        value = self._environ.get("LOCAL_RANK")
        if value is None or not value.strip():
            return 0
        index = _env_int_value("LOCAL_RANK", value)
        if index < 0:
            raise ClusterConfigError(f"LOCAL_RANK={value!r} is negative")
        return index

    def __repr__(self) -> str:
        try:
            return (
                f"{type(self).__name__}(cluster_spec={self.cluster_spec()!r}, "
                f"task_type={self.task_type!r}, task_id={self.task_id!r})"
            )
        except ClusterConfigError as error:
            return f"{type(self).__name__}(<invalid: {error}>)"


def _env_int_value(name: str, value: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise ClusterConfigError(f"{name}={value!r} is not an integer") from None


def _env_int(
    environ: Mapping[str, str],
    name: str,
    *,
    default: int | None = None,
    minimum: int | None = None,
    maximum: int | None = None,
    hint: str = "",
) -> int:
    value = environ.get(name)
    if value is None or not value.strip():
        if default is not None:
            return default
        raise ClusterConfigError(f"environment variable {name} is not set{hint}")
    number = _env_int_value(name, value)
    if minimum is not None and number < minimum:
        raise ClusterConfigError(f"{name}={value!r} is below {minimum}")
    if maximum is not None and number > maximum:
        raise ClusterConfigError(f"{name}={value!r} is above {maximum}")
    return number


class SimpleClusterResolver(ClusterResolver):
    """A resolver holding given values (TensorFlow's ``SimpleClusterResolver``).

    Args:
        cluster_spec: the cluster (a ``ClusterSpec`` or its dict form); empty for a single
            local worker.
        task_type, task_id: this task's place in the cluster.
        num_accelerators: what ``num_accelerators()`` returns (default: the visible GPUs).
        rpc_layer, environment: returned as given.
        master: what ``master()`` returns when non-empty (TensorFlow 1 compatibility).
        environ: where ``LOCAL_RANK`` is read from (default ``os.environ``).

    >>> r = SimpleClusterResolver({"chief": ["c:1"], "worker": ["w:1"]}, "worker", 0)
    >>> r.worker_index, r.is_chief
    (1, False)
    """

    def __init__(
        self,
        cluster_spec: ClusterSpecLike,
        task_type: str | None = None,
        task_id: int | None = None,
        num_accelerators: Mapping[str, int] | None = None,
        rpc_layer: str | None = None,
        environment: str = "",
        *,
        master: str = "",
        environ: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(task_type=task_type, task_id=task_id, rpc_layer=rpc_layer, environ=environ)
        self._cluster_spec = ClusterSpec(cluster_spec)
        self._num_accelerators = None if num_accelerators is None else dict(num_accelerators)
        self._environment = environment
        self._master = master

    def cluster_spec(self) -> ClusterSpec:
        return ClusterSpec(self._cluster_spec)

    @property
    def environment(self) -> str:
        return self._environment

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None
    ) -> dict[str, int]:
        if self._num_accelerators is not None:
            return dict(self._num_accelerators)
        return super().num_accelerators(task_type, task_id)

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        if self._master:
            return self._master
        return super().master(task_type, task_id, rpc_layer)


class TFConfigClusterResolver(ClusterResolver):
    """Reads the ``TF_CONFIG`` environment variable, exactly as TensorFlow does.

    ``TF_CONFIG`` is JSON: ``{"cluster": {job: [host:port, ...]}, "task": {"type": job,
    "index": i}, "rpc_layer": ..., "environment": ...}``. It is re-read on every access, so
    changing it later takes effect; constructor arguments override it. No ``cluster`` (or no
    ``TF_CONFIG``) means an empty cluster: a single local worker.

    Args:
        task_type, task_id, rpc_layer, environment: override the ``TF_CONFIG`` values.
        environ: where ``TF_CONFIG`` and ``LOCAL_RANK`` are read (default ``os.environ``).

    >>> import json
    >>> tf_config = {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": "1"}}
    >>> r = TFConfigClusterResolver(environ={"TF_CONFIG": json.dumps(tf_config)})
    >>> r.task_type, r.task_id, r.num_workers, r.is_chief
    ('worker', 1, 2, False)
    """

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        environment: str | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(task_type=task_type, task_id=task_id, rpc_layer=rpc_layer, environ=environ)
        self._environment = environment

    def _tf_config(self) -> dict[str, object]:
        raw = self._environ.get(_TF_CONFIG)
        if raw is None or not raw.strip():
            return {}
        try:
            config = json.loads(raw)
        except json.JSONDecodeError as error:
            shown = raw if len(raw) <= 200 else raw[:200] + "..."
            raise ClusterConfigError(f"TF_CONFIG is not valid JSON ({error}): {shown!r}") from None
        if not isinstance(config, dict):
            raise ClusterConfigError(
                f'TF_CONFIG must be a JSON object like {{"cluster": {{...}}, "task": {{...}}}}, '
                f"got {type(config).__name__}: {config!r}"
            )
        return config

    def _task(self) -> dict[str, object]:
        task = self._tf_config().get("task")
        if task is None:
            return {}
        if not isinstance(task, dict):
            raise ClusterConfigError(
                f'TF_CONFIG task must be an object like {{"type": "worker", "index": 0}}, '
                f"got {task!r}"
            )
        return task

    def cluster_spec(self) -> ClusterSpec:
        """The ``cluster`` of ``TF_CONFIG`` (empty when missing)."""
        cluster = self._tf_config().get("cluster")
        if not cluster:
            return ClusterSpec({})
        try:
            return ClusterSpec(cluster)  # type: ignore[arg-type]
        except ClusterConfigError as error:
            raise ClusterConfigError(f"TF_CONFIG {error}") from None

    def _default_task_type(self) -> str | None:
        task_type = self._task().get("type")
        return None if task_type is None else str(task_type)

    def _default_task_id(self) -> int | None:
        return _coerce_index(self._task().get("index"), "TF_CONFIG task.index")

    def _default_rpc_layer(self) -> str | None:
        rpc_layer = self._tf_config().get("rpc_layer")
        return None if rpc_layer is None else str(rpc_layer)

    @property
    def environment(self) -> str:
        if self._environment is not None:
            return self._environment
        return str(self._tf_config().get("environment") or "")

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        session_master = self._tf_config().get("session_master")
        if session_master:
            return str(session_master)
        return super().master(task_type, task_id, rpc_layer)

    @classmethod
    def is_present(cls, environ: Mapping[str, str] | None = None) -> bool:
        """True when ``TF_CONFIG`` is set and describes a non-empty cluster.

        Raises:
            ClusterConfigError: ``TF_CONFIG`` is set but is not valid JSON.
        """
        return bool(cls(environ=environ).cluster_spec())


def _format_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class TorchrunClusterResolver(ClusterResolver):
    """Reads the environment ``torchrun`` (and ``torch-distribute launch``) gives a worker.

    ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are required;
    ``LOCAL_RANK`` (default 0) and ``LOCAL_WORLD_SIZE`` (default 1) are optional. Every
    process is a ``"worker"`` (torchrun has no separate chief: rank 0 plays that part),
    ``task_id`` is ``RANK`` and ``num_workers`` is ``WORLD_SIZE``.

    torchrun only tells a process where rank 0 listens, so ``cluster_spec()`` is
    ``{"worker": ["MASTER_ADDR:MASTER_PORT", "rank1", "rank2", ...]}``: entry 0 is the
    rendezvous address and the others are placeholders (``f"rank{i}"``), not addresses.

    Raises:
        ClusterConfigError: a variable missing or not a valid number, naming it.

    >>> env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    >>> r = TorchrunClusterResolver(environ=env)
    >>> r.cluster_spec()
    ClusterSpec({'worker': ['10.0.0.1:29500', 'rank1']})
    >>> r.worker_index, r.is_chief, r.rendezvous_address()
    (1, False, ('10.0.0.1', 29500))
    """

    _HINT = " (torchrun sets it; are you running under torchrun?)"

    def __init__(
        self, *, rpc_layer: str | None = None, environ: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(rpc_layer=rpc_layer, environ=environ)
        env = self._environ
        self._world_size = _env_int(env, "WORLD_SIZE", minimum=1, hint=self._HINT)
        self._rank = _env_int(env, "RANK", minimum=0, hint=self._HINT)
        if self._rank >= self._world_size:
            raise ClusterConfigError(
                f"RANK={self._rank} must be below WORLD_SIZE={self._world_size}"
            )
        self._local_world_size = _env_int(env, "LOCAL_WORLD_SIZE", default=1, minimum=1)
        self._local_rank = _env_int(env, "LOCAL_RANK", default=0, minimum=0)
        if "LOCAL_WORLD_SIZE" in env and self._local_rank >= self._local_world_size:
            raise ClusterConfigError(
                f"LOCAL_RANK={self._local_rank} must be below "
                f"LOCAL_WORLD_SIZE={self._local_world_size}"
            )
        master_addr = env.get("MASTER_ADDR", "").strip()
        if not master_addr:
            raise ClusterConfigError(f"environment variable MASTER_ADDR is not set{self._HINT}")
        self._master_addr = master_addr.strip("[]")
        self._master_port = _env_int(env, "MASTER_PORT", minimum=1, maximum=65535, hint=self._HINT)

    @classmethod
    def is_present(cls, environ: Mapping[str, str] | None = None) -> bool:
        """True when ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` are all set."""
        env = os.environ if environ is None else environ
        return all(env.get(name) for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))

    def cluster_spec(self) -> ClusterSpec:
        first = _format_host_port(self._master_addr, self._master_port)
        return ClusterSpec({"worker": [first] + [f"rank{i}" for i in range(1, self._world_size)]})

    def _default_task_type(self) -> str | None:
        return "worker"

    def _default_task_id(self) -> int | None:
        return self._rank

    @property
    def world_size(self) -> int:
        """``WORLD_SIZE``."""
        return self._world_size

    @property
    def local_rank(self) -> int:
        """``LOCAL_RANK`` (0 when unset)."""
        return self._local_rank

    @property
    def local_world_size(self) -> int:
        """``LOCAL_WORLD_SIZE`` (1 when unset): workers on this machine."""
        return self._local_world_size

    def rendezvous_address(self) -> tuple[str, int]:
        """``(MASTER_ADDR, MASTER_PORT)``."""
        self.validate()
        return self._master_addr, self._master_port


# -- SLURM ------------------------------------------------------------------------------

#: Where ``SlurmClusterResolver`` remembers ``CUDA_VISIBLE_DEVICES`` as it was before it
#: narrowed it to this task's GPUs, so that building the resolver again is idempotent.
_SLURM_VISIBLE_DEVICES_KEY = "TORCH_DISTRIBUTE_SLURM_VISIBLE_DEVICES"


def _first_env(environ: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """``(name, value)`` of the first of ``names`` that is set and non-empty."""
    for name in names:
        value = environ.get(name)
        if value is not None and value.strip():
            return name, value.strip()
    return None


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
        return _env_int_value("SLURM_GPUS_ON_NODE", on_node)
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
        env = self._environ
        hint = " (SLURM sets it inside a job step: start the workers with srun)"
        self._rank = _env_int(env, "SLURM_PROCID", minimum=0, hint=hint)
        self._port_base = int(port_base)

        configuration = self._task_configuration(tasks_per_node)
        self._hosts = list(configuration)
        total = sum(configuration.values())
        if total == 0:
            raise ClusterConfigError("the SLURM step has no tasks on any node")

        num_tasks = _first_env(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        if jobs is None:
            jobs = {"worker": total if num_tasks is None else _env_int_value(*num_tasks)}
        self._jobs = {str(job): int(n) for job, n in jobs.items()}
        if any(n < 0 for n in self._jobs.values()):
            raise ClusterConfigError(f"jobs must have non-negative task counts, got {self._jobs}")
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
        if gpus_per_task is None:
            gpus_per_task = gpus_per_node // max_tasks
        if gpus_per_node < 0 or gpus_per_task < 0:
            raise ClusterConfigError("gpus_per_node and gpus_per_task must not be negative")
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
        env = self._environ
        if isinstance(tasks_per_node, Mapping):
            return {str(host): int(n) for host, n in tasks_per_node.items()}
        found = _first_env(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
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
            return dict.fromkeys(hosts, int(tasks_per_node))
        found = _first_env(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
        if found is not None:
            name, text = found
            counts = expand_tasks_per_node(text)
            if len(counts) != len(hosts):
                raise ClusterConfigError(
                    f"{name}={text!r} gives {len(counts)} nodes but the node list "
                    f"{nodelist!r} has {len(hosts)}"
                )
            return dict(zip(hosts, counts, strict=True))
        per_node = _first_env(env, "SLURM_NTASKS_PER_NODE")
        if per_node is not None:
            return dict.fromkeys(hosts, _env_int_value(*per_node))
        num_tasks = _first_env(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        if num_tasks is not None and _env_int_value(*num_tasks) % len(hosts) == 0:
            return dict.fromkeys(hosts, _env_int_value(*num_tasks) // len(hosts))
        raise ClusterConfigError(
            "cannot tell how many tasks run on each node: set SLURM_STEP_TASKS_PER_NODE "
            "(srun does) or pass tasks_per_node="
        )

    def _gpu_ids(self, local_index: int) -> list[str]:
        visible = _visible_devices(self._environ)
        first = local_index * self._gpus_per_task
        ids = range(first, first + self._gpus_per_task)
        if visible is not None and len(visible) >= first + self._gpus_per_task:
            return [visible[i] for i in ids]
        return [str(i) for i in ids]

    def _set_visible_devices(self) -> None:
        env = self._environ
        if not isinstance(env, MutableMapping):
            return
        ids = ",".join(self._gpu_ids(self._local_index[self._rank]))
        if _SLURM_VISIBLE_DEVICES_KEY not in env:
            env[_SLURM_VISIBLE_DEVICES_KEY] = env.get("CUDA_VISIBLE_DEVICES", "")
        env["CUDA_VISIBLE_DEVICES"] = ids

    @classmethod
    def is_present(cls, environ: Mapping[str, str] | None = None) -> bool:
        """True when ``SLURM_PROCID`` and a node list are set (inside a SLURM step)."""
        env = os.environ if environ is None else environ
        nodelist = _first_env(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        return bool(env.get("SLURM_PROCID")) and nodelist is not None

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


def resolve_cluster(environ: Mapping[str, str] | None = None) -> ClusterResolver:
    """The resolver for the environment this process runs in.

    In order: ``TF_CONFIG`` (when set with a non-empty ``cluster``), torchrun's variables
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``), a SLURM step (``SLURM_PROCID`` and a node
    list); otherwise ``SimpleClusterResolver(ClusterSpec({}))``: a single local worker.

    Raises:
        ClusterConfigError: the chosen source is malformed (e.g. ``TF_CONFIG`` is not JSON);
            a broken description is never silently skipped.

    >>> r = resolve_cluster({})
    >>> type(r).__name__, r.num_workers, r.worker_index, r.is_chief
    ('SimpleClusterResolver', 1, 0, True)
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    if TFConfigClusterResolver.is_present(env):
        return TFConfigClusterResolver(environ=env)
    if TorchrunClusterResolver.is_present(env):
        return TorchrunClusterResolver(environ=env)
    if SlurmClusterResolver.is_present(env):
        return SlurmClusterResolver(environ=env)
    return SimpleClusterResolver(ClusterSpec({}), environ=env)
