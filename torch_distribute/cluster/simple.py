"""``SimpleClusterResolver``: a cluster and a task given as values, not read from anywhere.

For tests, notebooks and programs that build their cluster themselves (TensorFlow's
``SimpleClusterResolver``); ``resolve_cluster()`` falls back to one with an empty cluster,
a single local worker.

>>> r = SimpleClusterResolver({"worker": ["a:1", "b:1"]}, "worker", 1)
>>> r.num_workers, r.worker_index, r.is_chief, r.rendezvous_address()
(2, 1, False, ('a', 1))
"""

from __future__ import annotations

from collections.abc import Mapping

from torch_distribute.cluster.base import ClusterResolver, ConfigFields
from torch_distribute.cluster.cluster_spec import ClusterSpec, ClusterSpecLike
from torch_distribute.errors import ClusterConfigError

__all__ = ["SimpleClusterResolver"]


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

    Raises:
        ClusterConfigError: ``cluster_spec`` is not a mapping of job -> addresses (at once);
            an address that is not ``host:port`` with a port in 1..65535, a duplicate
            address or a task not in the cluster when the cluster is first used
            (``validate()``), naming the argument (``cluster_spec["worker"][1]``, ``task_id``).

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
        self._cluster_spec = ClusterSpec(cluster_spec, field="cluster_spec")
        if num_accelerators is not None and not (
            isinstance(num_accelerators, Mapping)
            and all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                    for k, v in num_accelerators.items())
        ):
            raise ClusterConfigError(
                "num_accelerators must be a dict of device type -> count such as {'GPU': 2}, "
                f"got {num_accelerators!r}"
            )
        for name, value in (("environment", environment), ("master", master)):
            if not isinstance(value, str):
                raise ClusterConfigError(f"{name} must be a string, got {type(value).__name__}: {value!r}")
        self._num_accelerators = None if num_accelerators is None else dict(num_accelerators)
        self._environment = environment
        self._master = master

    def cluster_spec(self) -> ClusterSpec:
        return ClusterSpec(self._cluster_spec)

    def config_fields(self) -> ConfigFields:
        """The constructor's arguments: ``cluster_spec``, ``task_type``, ``task_id``."""
        return ConfigFields(cluster="cluster_spec", task_type="task_type", task_id="task_id")

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
