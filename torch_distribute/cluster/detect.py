"""``resolve_cluster()``: pick the resolver for the environment this process runs in.

The resolvers in ``RESOLVERS`` are asked in order whether their environment applies
(``is_present``); the first that says yes is built. Variables of a launcher that are
present but incomplete or inconsistent raise ``ClusterConfigError`` (never a silent single
worker). With none, the process is a single local worker (``SimpleClusterResolver`` with
an empty cluster), which is logged at INFO on the ``torch_distribute.cluster`` logger.

>>> r = resolve_cluster({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
>>> type(r).__name__, r.worker_index
('TorchrunClusterResolver', 1)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from torch_distribute.cluster.base import ClusterResolver
from torch_distribute.cluster.cluster_spec import ClusterSpec
from torch_distribute.cluster.env import environ_or_default, seen_variables
from torch_distribute.cluster.kubeflow import KubeflowClusterResolver
from torch_distribute.cluster.launcher_agreement import check_launchers_agree
from torch_distribute.cluster.mpi import MPIClusterResolver
from torch_distribute.cluster.simple import SimpleClusterResolver
from torch_distribute.cluster.slurm_batch import SlurmBatchClusterResolver
from torch_distribute.cluster.slurm_resolver import SlurmClusterResolver
from torch_distribute.cluster.tf_config import TFConfigClusterResolver
from torch_distribute.cluster.torchrun import TorchrunClusterResolver
from torch_distribute.errors import ClusterConfigError

__all__ = ["RESOLVERS", "resolve_cluster"]

logger = logging.getLogger("torch_distribute.cluster")

#: The resolvers ``resolve_cluster()`` tries, in order: an explicit ``TF_CONFIG`` wins over
#: torchrun's variables (set per worker by torchrun, our launcher, Kubeflow's PyTorchJob, Ray
#: Train, accelerate), which win over ``mpirun``'s ranks, over a SLURM step (``srun torchrun
#: ...`` sets both), over Kubeflow's ``PET_*`` for a script run directly; last, a SLURM batch
#: script without ``srun``, which is one worker.
RESOLVERS: tuple[type[ClusterResolver], ...] = (
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    MPIClusterResolver,
    SlurmClusterResolver,
    KubeflowClusterResolver,
    SlurmBatchClusterResolver,
)


def resolve_cluster(environ: Mapping[str, str] | None = None) -> ClusterResolver:
    """The resolver for the environment this process runs in.

    In order: ``TF_CONFIG`` (when set with a non-empty ``cluster``), torchrun's variables
    (``RANK``/``WORLD_SIZE``, with ``MASTER_ADDR``/``MASTER_PORT``), MPI's ranks
    (``OMPI_COMM_WORLD_*``, ``PMI_*``, with ``MASTER_ADDR``/``MASTER_PORT``), a SLURM step
    started by ``srun``, Kubeflow's ``PET_*``, a SLURM batch script without ``srun`` (one
    worker); otherwise ``SimpleClusterResolver(ClusterSpec({}))``: a single local worker.

    Raises:
        ClusterConfigError: the chosen source is malformed or incomplete (e.g. ``TF_CONFIG``
            is not JSON, ``RANK`` without ``WORLD_SIZE``, ``WORLD_SIZE=2`` without
            ``MASTER_ADDR``, ``mpirun`` without ``MASTER_ADDR``), or two systems' variables
            disagree about this process; a broken description is never silently skipped.

    >>> r = resolve_cluster({})
    >>> type(r).__name__, r.num_workers, r.worker_index, r.is_chief
    ('SimpleClusterResolver', 1, 0, True)
    """
    env = environ_or_default(environ)
    for resolver_class in RESOLVERS:
        if resolver_class.is_present(env):
            if resolver_class is not TFConfigClusterResolver:
                check_launchers_agree(env)
            resolver = resolver_class(environ=env)
            _log_choice(resolver)
            return resolver
    ignored = seen_variables(env, ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"))
    logger.info(
        "no cluster environment found (TF_CONFIG, RANK/WORLD_SIZE, MPI ranks, a SLURM step, "
        "Kubeflow PET_*): this process is a single worker%s",
        "" if ignored == "none of them" else f" ({ignored} alone describe no cluster)",
    )
    return SimpleClusterResolver(ClusterSpec({}), environ=env)


def _log_choice(resolver: ClusterResolver) -> None:
    if isinstance(resolver, SlurmBatchClusterResolver):
        tasks = resolver.requested_tasks
        if tasks is not None and tasks > 1:
            logger.warning(
                "in a SLURM job but not in an srun step: this process is one worker, although the "
                "job has SLURM_NTASKS=%d; start the script with `srun python train.py` to run "
                "%d workers", tasks, tasks)
        else:
            logger.info("in a SLURM job but not in an srun step: this process is a single worker")
        return
    if logger.isEnabledFor(logging.INFO):
        try:
            place = f"worker {resolver.worker_index} of {resolver.num_workers}"
        except ClusterConfigError as error:  # reported where the cluster is used
            place = f"invalid: {error}"
        logger.info("cluster from %s: %s", type(resolver).__name__, place)
