"""``TFConfigClusterResolver``: the cluster described by the ``TF_CONFIG`` variable.

``TF_CONFIG`` is read exactly as TensorFlow reads it (``cluster``, ``task``,
``rpc_layer``, ``environment``, ``session_master``), and it applies (``is_present``) when it
describes a non-empty cluster.

>>> import json
>>> env = {"TF_CONFIG": json.dumps({
...     "cluster": {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"]},
...     "task": {"type": "worker", "index": 1}})}
>>> TFConfigClusterResolver.is_present(env)
True
>>> r = TFConfigClusterResolver(environ=env)
>>> r.num_workers, r.worker_index, r.is_chief, r.rendezvous_address()
(3, 2, False, ('c', 2222))
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from torch_distribute.cluster.base import ClusterResolver, ConfigFields, coerce_index
from torch_distribute.cluster.cluster_spec import ClusterSpec
from torch_distribute.errors import ClusterConfigError

__all__ = ["TF_CONFIG", "TFConfigClusterResolver"]

#: The environment variable holding the JSON cluster description.
TF_CONFIG = "TF_CONFIG"

_CLUSTER = 'TF_CONFIG["cluster"]'
_TASK = 'TF_CONFIG["task"]'
_TASK_TYPE = 'TF_CONFIG["task"]["type"]'
_TASK_INDEX = 'TF_CONFIG["task"]["index"]'

#: The tasks a ``TF_CONFIG`` without a cluster may name: the single local worker.
_LOCAL_TASK_TYPES = (None, "chief", "worker", "evaluator")


def _object_without_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object; a key given twice (the second would silently win) is an error."""
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ClusterConfigError(
                f"TF_CONFIG has the key {key!r} twice in one object ({out[key]!r} and "
                f"{value!r}); JSON would keep only the last: remove one"
            )
        out[key] = value
    return out


class TFConfigClusterResolver(ClusterResolver):
    """Reads the ``TF_CONFIG`` environment variable, exactly as TensorFlow does.

    ``TF_CONFIG`` is JSON: ``{"cluster": {job: [host:port, ...]}, "task": {"type": job,
    "index": i}, "rpc_layer": ..., "environment": ...}``. It is re-read on every access, so
    changing it later takes effect; constructor arguments override it. No ``cluster`` (or no
    ``TF_CONFIG``) means an empty cluster: a single local worker, which its ``task`` (if
    any) must then be (index 0): a ``task`` such as worker 1 without a cluster is an error,
    not a worker silently training alone.

    Every malformed field raises ``ClusterConfigError`` naming it, e.g.
    ``TF_CONFIG["cluster"]["worker"][1] 'w1:70000' has port 70000, but a port must be in
    1..65535``.

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
        raw = self.environ.get(TF_CONFIG)
        if raw is None or not raw.strip():
            return {}
        try:
            config = json.loads(raw, object_pairs_hook=_object_without_duplicate_keys)
        except json.JSONDecodeError as error:
            shown = raw if len(raw) <= 200 else raw[:200] + "..."
            raise ClusterConfigError(
                f"TF_CONFIG is not valid JSON ({error}): {shown!r}; JSON needs double quotes "
                "around every name and string"
            ) from None
        if not isinstance(config, dict):
            raise ClusterConfigError(
                f'TF_CONFIG must be a JSON object like {{"cluster": {{...}}, "task": {{...}}}}, '
                f"got {type(config).__name__}: {config!r}"
            )
        return config

    def _string_field(self, key: str) -> str | None:
        """A top-level string field of ``TF_CONFIG`` (``rpc_layer``, ...), or ``None``."""
        value = self._tf_config().get(key)
        if value is not None and not isinstance(value, str):
            raise ClusterConfigError(
                f'TF_CONFIG["{key}"] must be a string, got {type(value).__name__}: {value!r}'
            )
        return value

    def _task(self) -> dict[str, object]:
        task = self._tf_config().get("task")
        if task is None:
            return {}
        if not isinstance(task, dict):
            raise ClusterConfigError(
                f'{_TASK} must be an object like {{"type": "worker", "index": 0}}, '
                f"got {type(task).__name__}: {task!r}"
            )
        return task

    def cluster_spec(self) -> ClusterSpec:
        """The ``cluster`` of ``TF_CONFIG`` (empty when missing).

        Raises:
            ClusterConfigError: ``cluster`` is not an object of job -> addresses, or it is
                missing while ``task`` names a task other than the single local worker.
        """
        cluster = self._tf_config().get("cluster")
        if cluster is not None and not isinstance(cluster, dict):
            raise ClusterConfigError(
                f'{_CLUSTER} must be an object of job name -> list of "host:port" addresses, '
                f'e.g. {{"worker": ["host0:2222", "host1:2222"]}}; got '
                f"{type(cluster).__name__}: {cluster!r}"
            )
        if not cluster:
            self._check_task_without_cluster()
            return ClusterSpec({})
        return ClusterSpec(cluster, field=_CLUSTER)

    def _check_task_without_cluster(self) -> None:
        """No cluster is one local worker; a ``task`` saying otherwise is a broken config."""
        task = self._task()
        task_type = task.get("type")
        index = coerce_index(task.get("index"), f"{_TASK_INDEX}: task.index")
        if task_type in _LOCAL_TASK_TYPES and index in (None, 0):
            return
        raise ClusterConfigError(
            f"{_CLUSTER} is missing or empty but {_TASK} is {task!r}: without a cluster this "
            "process would train alone as a single local worker. Add the cluster "
            '(e.g. "cluster": {"worker": ["host0:2222", "host1:2222"]}) or remove "task".'
        )

    def config_fields(self) -> ConfigFields:
        """``TF_CONFIG["cluster"]``, ``TF_CONFIG["task"]["type"]`` and ``...["index"]``
        (``task_type``/``task_id`` when given to the constructor)."""
        return ConfigFields(
            cluster=_CLUSTER,
            task_type=_TASK_TYPE if self._task_type is None else "task_type",
            task_id=_TASK_INDEX if self._task_id is None else "task_id",
        )

    def validate(self) -> ClusterSpec:
        """Check every field of ``TF_CONFIG`` (also ``rpc_layer``, ``environment`` and
        ``session_master``, which must be strings), then the cluster and this task's place.

        Raises:
            ClusterConfigError: naming the field, e.g. ``TF_CONFIG["cluster"]["worker"][1]``.
        """
        for key in ("rpc_layer", "environment", "session_master"):
            self._string_field(key)
        return super().validate()

    def _default_task_type(self) -> str | None:
        task_type = self._task().get("type")
        if task_type is not None and not isinstance(task_type, str):
            raise ClusterConfigError(
                f"{_TASK_TYPE} must be a string such as \"worker\", got "
                f"{type(task_type).__name__}: {task_type!r}"
            )
        return task_type

    def _default_task_id(self) -> int | None:
        return coerce_index(self._task().get("index"), f"{_TASK_INDEX}: task.index")

    def _default_rpc_layer(self) -> str | None:
        return self._string_field("rpc_layer")

    @property
    def environment(self) -> str:
        if self._environment is not None:
            return self._environment
        return self._string_field("environment") or ""

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        session_master = self._string_field("session_master")
        if session_master:
            return session_master
        return super().master(task_type, task_id, rpc_layer)

    @classmethod
    def is_present(cls, environ: Mapping[str, str] | None = None) -> bool:
        """True when ``TF_CONFIG`` is set and describes a non-empty cluster.

        Raises:
            ClusterConfigError: ``TF_CONFIG`` is set but is not valid JSON, its ``cluster``
                is malformed, or it names a ``task`` (other than worker 0) without a cluster:
                a broken ``TF_CONFIG`` is never skipped in favour of another resolver.
        """
        return bool(cls(environ=environ).cluster_spec())
