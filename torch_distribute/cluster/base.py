"""The base of every cluster resolver, and TensorFlow's validation of a cluster.

``ClusterResolver`` is the abstract base: ``cluster_spec()`` and this task's place in it
(``task_type``, ``task_id``), from which it derives what a multi-worker strategy needs to
form a ``torch.distributed`` process group (``num_workers``, ``worker_index``,
``is_chief``, ``rendezvous_address()``, ``local_rank``). Each source of a cluster
description is a subclass in its own module (``simple``, ``tf_config``, ``torchrun``,
``slurm_resolver``) that also answers the classmethod ``is_present(environ)``: does its
environment apply? ``detect.resolve_cluster()`` asks them in order.

A new resolver implements ``cluster_spec()``, the ``_default_task_type()`` /
``_default_task_id()`` hooks and ``is_present()``, and is added to ``detect.RESOLVERS``:

>>> class OneHost(ClusterResolver):
...     @classmethod
...     def is_present(cls, environ=None):
...         return "ONE_HOST" in environ_or_default(environ)
...     def cluster_spec(self):
...         return ClusterSpec({"worker": [self.environ["ONE_HOST"]]})
...     def _default_task_type(self):
...         return "worker"
...     def _default_task_id(self):
...         return 0
>>> OneHost.is_present({"ONE_HOST": "h:1"}), OneHost(environ={"ONE_HOST": "h:1"}).rendezvous_address()
(True, ('h', 1))
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from torch_distribute.cluster.cluster_spec import (
    ClusterSpec,
    ClusterSpecLike,
    field_path,
    split_address,
)
from torch_distribute.cluster.env import env_int_value, environ_or_default
from torch_distribute.errors import ClusterConfigError

__all__ = [
    "VALID_TASK_TYPES",
    "ClusterResolver",
    "ConfigFields",
    "coerce_index",
    "validate_cluster_spec",
]

#: The job names a multi-worker cluster may have, as in TensorFlow.
VALID_TASK_TYPES = ("chief", "worker", "evaluator", "ps")

#: ``rendezvous_address()`` of a single local worker: nobody else has to find it, so any
#: free port will do (port 0).
_LOCAL_RENDEZVOUS = ("127.0.0.1", 0)


def _quoted(names: tuple[str, ...] | list[str]) -> str:
    return ", ".join(repr(n) for n in names)


def coerce_index(value: object, field: str) -> int | None:
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


@dataclass(frozen=True)
class ConfigFields:
    """What a cluster description calls its fields, so validation errors name them.

    ``cluster`` prefixes the address of each task (``TF_CONFIG["cluster"]["worker"][1]``);
    ``task_type`` and ``task_id`` name where this task's place came from. With
    ``check_addresses=False`` the addresses are not checked as ``host:port`` (torchrun's
    cluster has placeholders for every rank but 0; its ``MASTER_ADDR``/``MASTER_PORT`` are
    checked when it is built).

    >>> ConfigFields().task_id
    'task.index'
    """

    cluster: str = "cluster"
    task_type: str = "task.type"
    task_id: str = "task.index"
    check_addresses: bool = True


_DEFAULT_FIELDS = ConfigFields()


def _naming(field: str, default: str) -> str:
    """A message prefix naming ``field`` unless it is the generic name already in the text."""
    return "" if field == default else f"{field}: "


def validate_cluster_spec(
    cluster_spec: ClusterSpecLike,
    task_type: str | None,
    task_id: int | None,
    *,
    fields: ConfigFields | None = None,
) -> None:
    """Check a multi-worker cluster and this task's place in it (TensorFlow's rules).

    An empty cluster is a single local worker and always valid. Otherwise:

    - every job is one of ``chief``, ``worker``, ``evaluator``, ``ps``;
    - at most one ``chief`` task and at most one ``evaluator`` task;
    - every address is ``host:port`` with a port in 1..65535 (``split_address``);
    - no address is used by two tasks;
    - ``task_type`` and ``task_id`` are both given (``task`` in ``TF_CONFIG``);
    - ``task_type`` is a valid job name and a job of the cluster (an ``evaluator`` may be
      missing from the cluster: it runs on its own);
    - ``task_id`` is an integer index of a task of that job.

    ``fields`` says what the source calls the fields (default: ``cluster``, ``task.type``,
    ``task.index``); errors are prefixed with the field to fix.

    Raises:
        ClusterConfigError: naming the field to fix (``cluster``, ``task.type``,
            ``task.index``, or the source's own names from ``fields``).

    >>> validate_cluster_spec({"worker": ["a:1", "b:1"]}, "worker", 1)
    >>> validate_cluster_spec({"worker": ["a:1", "b:1"]}, "worker", 2)
    Traceback (most recent call last):
    ...
    torch_distribute.errors.ClusterConfigError: task.index 2 is past the end of job 'worker', which has 2 tasks (valid indices are 0..1)
    """
    fields = fields or _DEFAULT_FIELDS
    spec = ClusterSpec(cluster_spec, field=fields.cluster)
    if not spec:
        return
    cluster_prefix = _naming(fields.cluster, "cluster")
    type_prefix = _naming(fields.task_type, "task.type")
    id_prefix = _naming(fields.task_id, "task.index")
    jobs = spec.jobs
    for job in jobs:
        if job not in VALID_TASK_TYPES:
            hint = " (TensorFlow 1's 'master' is called 'chief' here)" if job == "master" else ""
            raise ClusterConfigError(
                f"{cluster_prefix}cluster has an unknown job {job!r}{hint}; job names must be "
                f"among {_quoted(VALID_TASK_TYPES)}"
            )
    for job in ("chief", "evaluator"):
        if job in jobs and spec.num_tasks(job) > 1:
            raise ClusterConfigError(
                f"{field_path(fields.cluster, job)}: cluster job {job!r} has "
                f"{spec.num_tasks(job)} tasks; there must be at most one {job!r} task"
            )
    owners: dict[tuple[str, int] | str, tuple[str, int]] = {}
    for job in jobs:
        for index in spec.task_indices(job):
            address = spec.task_address(job, index)
            where = field_path(fields.cluster, job, index)
            key: tuple[str, int] | str = address
            if fields.check_addresses:
                host, port = split_address(address, what=where)
                key = (host.lower(), port)  # host names are case-insensitive
            if key in owners:
                other_job, other_index = owners[key]
                raise ClusterConfigError(
                    f"{where}: cluster address {address!r} is used by two tasks, {other_job} "
                    f"{other_index} and {job} {index}; every task needs its own host:port"
                )
            owners[key] = (job, index)

    if task_type is None and task_id is None:
        raise ClusterConfigError(
            "a cluster is given but not which task this process is: set `task` in TF_CONFIG, "
            'e.g. "task": {"type": "worker", "index": 0} (or pass task_type= and task_id= '
            "to the cluster resolver)"
        )
    if task_type is None:
        raise ClusterConfigError(
            f"{type_prefix}task.type is missing (task.index is {task_id!r}): set `task.type` in "
            f"TF_CONFIG to one of {_quoted(jobs)}"
        )
    if task_id is None:
        raise ClusterConfigError(
            f"{id_prefix}task.index is missing (task.type is {task_type!r}): set `task.index` "
            "in TF_CONFIG"
        )
    if not isinstance(task_type, str):
        raise ClusterConfigError(
            f"{type_prefix}task.type must be a string, one of {_quoted(VALID_TASK_TYPES)}; got "
            f"{task_type!r}"
        )
    if task_type not in VALID_TASK_TYPES:
        raise ClusterConfigError(
            f"{type_prefix}task.type {task_type!r} is not a valid task type; it must be one of "
            f"{_quoted(VALID_TASK_TYPES)}"
        )
    if task_type not in jobs and task_type != "evaluator":
        raise ClusterConfigError(
            f"{type_prefix}task.type {task_type!r} is not a job of the cluster, whose jobs are "
            f"{_quoted(jobs)}; add it to the cluster or fix the task type"
        )
    if isinstance(task_id, bool) or not isinstance(task_id, int):
        raise ClusterConfigError(f"{id_prefix}task.index must be an integer, got {task_id!r}")
    if task_id < 0:
        raise ClusterConfigError(f"{id_prefix}task.index {task_id} is negative")
    if task_type in jobs:
        indices = spec.task_indices(task_type)
        count = len(indices)
        if indices == list(range(count)):
            if task_id >= count:
                last = f"valid indices are 0..{count - 1}" if count else "it has no tasks"
                raise ClusterConfigError(
                    f"{id_prefix}task.index {task_id} is past the end of job {task_type!r}, "
                    f"which has {count} task{'' if count == 1 else 's'} ({last})"
                )
        elif task_id not in indices:
            raise ClusterConfigError(
                f"{id_prefix}task.index {task_id} is not a task of job {task_type!r}, whose "
                f"task indices are {indices}"
            )


class ClusterResolver(abc.ABC):
    """Base class: the cluster, this task's place in it, and the derived rendezvous facts.

    Subclasses implement ``cluster_spec()`` and may supply defaults for ``task_type`` /
    ``task_id`` / ``rpc_layer``; values set on the properties override them (as in
    TensorFlow).

    ``environ`` (every resolver takes it, default ``os.environ``) is where environment
    variables are read from, so a resolver can be built from a plain dict.

    >>> from torch_distribute.cluster import SimpleClusterResolver
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
        self._environ: Mapping[str, str] = environ_or_default(environ)

    @classmethod
    def is_present(cls, environ: Mapping[str, str] | None = None) -> bool:
        """Does this resolver's environment apply: is this process running under it?

        ``resolve_cluster()`` asks every resolver in ``detect.RESOLVERS`` in turn and builds
        the first that says yes. The answer depends only on the variables ``environ``
        (default ``os.environ``) has; a malformed value is left for the constructor to
        report (except ``TF_CONFIG``, which has to be parsed to tell). The base answers no:
        a resolver built from given values (``SimpleClusterResolver``) is never detected.
        """
        del environ
        return False

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
            return coerce_index(self._task_id, "task_id")
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

        >>> from torch_distribute.cluster import SimpleClusterResolver
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

    def config_fields(self) -> ConfigFields:
        """What this resolver's source calls its fields, for the errors of ``validate()``.

        The base names them ``cluster``, ``task.type`` and ``task.index``; a resolver reading
        a particular source overrides it (``TF_CONFIG["cluster"]``, ...).
        """
        return _DEFAULT_FIELDS

    def validate(self) -> ClusterSpec:
        """Check the cluster and this task's place in it; return the cluster.

        Raises:
            ClusterConfigError: see ``validate_cluster_spec``.
        """
        spec = self.cluster_spec()
        if spec:
            validate_cluster_spec(spec, self.task_type, self.task_id, fields=self.config_fields())
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
        index = env_int_value("LOCAL_RANK", value)
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
