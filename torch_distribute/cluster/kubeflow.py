"""``KubeflowClusterResolver``: Kubeflow's ``PET_*`` variables, for a script run directly.

Kubeflow Trainer v2 (a ``TrainJob``) gives each pod only torchrun's options as variables:
``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and
``PET_MASTER_PORT`` (PyTorchJob v1 sets them beside ``RANK``/``WORLD_SIZE``). ``torchrun``
and ``torch-distribute launch`` read them and hand every worker ``RANK``, ``WORLD_SIZE``,
... (then ``TorchrunClusterResolver`` applies). A script started directly (``python
train.py``) is the pod's one worker: this resolver makes pod ``PET_NODE_RANK`` worker
``PET_NODE_RANK`` of ``PET_NNODES``, meeting at ``PET_MASTER_ADDR:PET_MASTER_PORT``.

>>> env = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1",
...        "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29500"}
>>> KubeflowClusterResolver.is_present(env)
True
>>> r = KubeflowClusterResolver(environ=env)
>>> r.num_workers, r.worker_index, r.is_chief, r.rendezvous_address()
(2, 1, False, ('job-node-0-0.job', 29500))
"""

from __future__ import annotations

from collections.abc import Mapping

from torch_distribute.cluster.base import ClusterResolver, ConfigFields
from torch_distribute.cluster.cluster_spec import ClusterSpec, split_address
from torch_distribute.cluster.env import env_int, environ_or_default, seen_variables
from torch_distribute.errors import ClusterConfigError

__all__ = ["PET_VARS", "KubeflowClusterResolver", "pet_world_size"]

#: The variables Kubeflow sets for torchrun's options (PyTorchJob v1 and Trainer v2).
PET_VARS = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")

#: torchrun's default ``--master-port``, used when ``PET_MASTER_PORT`` is unset.
DEFAULT_MASTER_PORT = 29500

_RUN_WITH = ("start it with `torchrun train.py` or `torch-distribute launch train.py` "
             "(both read the PET_* variables)")


def pet_world_size(environ: Mapping[str, str]) -> int | None:
    """``PET_NNODES * PET_NPROC_PER_NODE`` when both are plain integers, else None.

    >>> pet_world_size({"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4"}), pet_world_size({"PET_NNODES": "1:4"})
    (8, None)
    """
    nnodes = environ.get("PET_NNODES", "").strip()
    nproc = environ.get("PET_NPROC_PER_NODE", "1").strip() or "1"
    if nnodes.isdigit() and nproc.isdigit():
        return int(nnodes) * int(nproc)
    return None


class KubeflowClusterResolver(ClusterResolver):
    """Reads Kubeflow's ``PET_*`` variables in a pod whose script runs directly.

    ``PET_NNODES`` is the number of workers and ``PET_NODE_RANK`` this worker's index;
    ``PET_MASTER_ADDR``/``PET_MASTER_PORT`` (default 29500, torchrun's) is where they meet.
    A directly started script is one process per pod, so ``PET_NPROC_PER_NODE`` must be 1
    (or unset).

    Raises:
        ClusterConfigError: naming the ``PET_*`` variables seen and what is missing or
            wrong: no ``PET_NNODES`` or ``PET_NODE_RANK``, no ``PET_MASTER_ADDR`` for more
            than one pod, an elastic ``PET_NNODES`` (``min:max``) or several processes per
            pod (those need torchrun).

    >>> KubeflowClusterResolver(environ={"PET_NODE_RANK": "1"})
    Traceback (most recent call last):
    ...
    torch_distribute.errors.ClusterConfigError: Kubeflow's PET_* variables are incomplete (seen: PET_NODE_RANK='1'): PET_NNODES is missing. Set PET_NNODES, PET_NODE_RANK and PET_MASTER_ADDR (Kubeflow sets them), or unset PET_* for a single-process run
    """

    def __init__(
        self, *, rpc_layer: str | None = None, environ: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(rpc_layer=rpc_layer, environ=environ)
        env = self.environ
        seen = seen_variables(env, PET_VARS)
        nnodes_text = env.get("PET_NNODES", "").strip()
        if ":" in nnodes_text:
            raise ClusterConfigError(
                f"PET_NNODES={nnodes_text!r} is an elastic range (seen: {seen}); a script started "
                f"directly cannot join an elastic job: {_RUN_WITH}"
            )
        nproc_text = env.get("PET_NPROC_PER_NODE", "").strip() or "1"
        if nproc_text != "1":
            raise ClusterConfigError(
                f"PET_NPROC_PER_NODE={nproc_text!r} asks for {nproc_text} processes per pod, but "
                f"this script was started directly, as one process (seen: {seen}): {_RUN_WITH}, "
                "or set numProcPerNode to 1"
            )
        required = ["PET_NNODES", "PET_NODE_RANK"]
        missing = [name for name in required if not env.get(name, "").strip()]
        if missing:
            raise ClusterConfigError(
                f"Kubeflow's PET_* variables are incomplete (seen: {seen}): "
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing. Set "
                "PET_NNODES, PET_NODE_RANK and PET_MASTER_ADDR (Kubeflow sets them), or unset "
                "PET_* for a single-process run"
            )
        self._nnodes = env_int(env, "PET_NNODES", minimum=1)
        self._node_rank = env_int(env, "PET_NODE_RANK", minimum=0)
        if self._node_rank >= self._nnodes:
            raise ClusterConfigError(
                f"PET_NODE_RANK={self._node_rank} must be below PET_NNODES={self._nnodes} (seen: {seen})"
            )
        self._address: tuple[str, int] | None = None
        master = env.get("PET_MASTER_ADDR", "").strip()
        if self._nnodes > 1 and not master:
            raise ClusterConfigError(
                f"PET_NNODES={self._nnodes} but PET_MASTER_ADDR is not set (seen: {seen}): the "
                "workers have nowhere to meet. Set PET_MASTER_ADDR (and PET_MASTER_PORT) to pod 0's "
                "address"
            )
        if master:
            port = env_int(env, "PET_MASTER_PORT", default=DEFAULT_MASTER_PORT, minimum=1, maximum=65535)
            self._address = split_address(f"{master}:{port}", what="PET_MASTER_ADDR:PET_MASTER_PORT")

    @classmethod
    def is_present(cls, environ: Mapping[str, str] | None = None) -> bool:
        """True when any of ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``,
        ``PET_MASTER_ADDR``, ``PET_MASTER_PORT`` is set."""
        env = environ_or_default(environ)
        return any(env.get(name, "").strip() for name in PET_VARS)

    def cluster_spec(self) -> ClusterSpec:
        if self._nnodes == 1:
            return ClusterSpec({})
        assert self._address is not None  # checked when built
        host, port = self._address
        return ClusterSpec({"worker": [f"{host}:{port}"] + [f"pod{i}" for i in range(1, self._nnodes)]})

    def config_fields(self) -> ConfigFields:
        """``PET_NODE_RANK`` is this task's index; entries past pod 0 are placeholders."""
        return ConfigFields(cluster="Kubeflow's cluster", task_type="task_type",
                            task_id="PET_NODE_RANK", check_addresses=False)

    def _default_task_type(self) -> str | None:
        return "worker"

    def _default_task_id(self) -> int | None:
        return self._node_rank

    def rendezvous_address(self) -> tuple[str, int]:
        """``(PET_MASTER_ADDR, PET_MASTER_PORT)`` (any free local port for one pod)."""
        if self._address is None:
            return super().rendezvous_address()
        return self._address
