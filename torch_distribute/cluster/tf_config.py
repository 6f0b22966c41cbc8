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

from torch_distribute.cluster.base import ClusterResolver, coerce_index
from torch_distribute.cluster.cluster_spec import ClusterSpec
from torch_distribute.errors import ClusterConfigError

__all__ = ["TF_CONFIG", "TFConfigClusterResolver"]

#: The environment variable holding the JSON cluster description.
TF_CONFIG = "TF_CONFIG"


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
        raw = self.environ.get(TF_CONFIG)
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
        return coerce_index(self._task().get("index"), "TF_CONFIG task.index")

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
