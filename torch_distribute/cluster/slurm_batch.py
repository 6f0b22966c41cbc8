"""``SlurmBatchClusterResolver``: a SLURM batch script (or ``salloc`` shell) without ``srun``.

Inside ``sbatch`` the batch script already sees ``SLURM_PROCID=0``, ``SLURM_NTASKS`` and the
job's node list, but it is one process: the tasks are only started by ``srun``. So outside
a job step this process is one worker (an empty cluster), whatever ``SLURM_NTASKS`` says;
``resolve_cluster`` logs that it asked for more. ``in_srun_step`` tells the two apart.

>>> batch = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"}
>>> SlurmBatchClusterResolver.is_present(batch), in_srun_step(batch)
(True, False)
>>> in_srun_step({**batch, "SLURM_STEP_ID": "0"})
True
>>> SlurmBatchClusterResolver(environ=batch).num_workers
1
"""

from __future__ import annotations

from collections.abc import Mapping

from torch_distribute.cluster.base import ClusterResolver
from torch_distribute.cluster.cluster_spec import ClusterSpec
from torch_distribute.cluster.env import environ_or_default, first_env

__all__ = ["SlurmBatchClusterResolver", "in_srun_step"]

#: Step ids at or above this are SLURM's special steps (interactive 0xfffffffa, batch,
#: extern, pending), not tasks started by srun.
_FIRST_SPECIAL_STEP = 0xFFFFFFFA

#: Variables only a job step started by srun has.
_STEP_ONLY = ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE")


def in_srun_step(environ: Mapping[str, str]) -> bool:
    """Whether this process is a task of a job step started by ``srun``.

    ``SLURM_STEP_ID`` (or ``SLURM_STEPID``) below SLURM's special step ids, or, where no
    step id is given, any of the ``SLURM_STEP_*`` variables.
    """
    step = first_env(environ, "SLURM_STEP_ID", "SLURM_STEPID")
    if step is not None:
        text = step[1]
        return text.isdigit() and int(text) < _FIRST_SPECIAL_STEP
    return first_env(environ, *_STEP_ONLY) is not None


class SlurmBatchClusterResolver(ClusterResolver):
    """One worker: this process runs in a SLURM allocation but not in an ``srun`` step.

    >>> r = SlurmBatchClusterResolver(environ={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"})
    >>> r.requested_tasks, r.is_chief
    (4, True)
    """

    @classmethod
    def is_present(cls, environ: Mapping[str, str] | None = None) -> bool:
        """True inside a SLURM job (``SLURM_JOB_ID``) but outside an ``srun`` step."""
        env = environ_or_default(environ)
        return first_env(env, "SLURM_JOB_ID", "SLURM_JOBID") is not None and not in_srun_step(env)

    def cluster_spec(self) -> ClusterSpec:
        return ClusterSpec({})

    @property
    def requested_tasks(self) -> int | None:
        """``SLURM_NTASKS`` (the tasks ``srun`` would start), None when unset or unreadable."""
        text = self.environ.get("SLURM_NTASKS", "").strip()
        return int(text) if text.isdigit() else None
