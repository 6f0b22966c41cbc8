"""Two launchers' variables in one process must describe the same worker.

A process may carry the variables of more than one system: ``RANK``/``WORLD_SIZE`` exported
by hand (or by a Kubeflow PyTorchJob) beside those ``mpirun``, ``srun`` or Kubeflow's
``PET_*`` set. When they disagree (``RANK=0`` exported once in a batch script, read by every
task of an ``srun`` step), trusting either one would make workers that train alone or wait
for each other forever, so ``check_launchers_agree`` raises ``ClusterConfigError`` naming
both. Where ``torchrun``'s agent (or ``torch-distribute launch``) started the process, its
``RANK``/``WORLD_SIZE`` describe the workers and the outer system's describe the agents, so
nothing is compared.

>>> check_launchers_agree({"RANK": "1", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
...                        "OMPI_COMM_WORLD_SIZE": "2"})
>>> check_launchers_agree({"RANK": "0", "WORLD_SIZE": "2", "SLURM_STEP_ID": "0",
...                        "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"})
Traceback (most recent call last):
...
torch_distribute.errors.ClusterConfigError: The launchers' variables disagree about this process: RANK='0', WORLD_SIZE='2' (torchrun's variables) make it worker 0 of 2, but SLURM_PROCID='1', SLURM_STEP_NUM_TASKS='2' (SLURM's step) make it worker 1 of 2. Keep only the variables of the system that starts the workers (RANK and WORLD_SIZE exported in a script are the same for every task: unset them, or set them per task)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from torch_distribute.cluster.env import first_env, seen_variables
from torch_distribute.cluster.kubeflow import pet_world_size
from torch_distribute.cluster.mpi import mpi_rank_and_size
from torch_distribute.cluster.slurm_batch import in_srun_step
from torch_distribute.errors import ClusterConfigError

__all__ = ["check_launchers_agree"]

#: Set by a per-node agent that starts the workers itself: torchrun's (also under
#: ``accelerate launch``) and ``torch-distribute launch``.
_AGENT_MARKERS = ("TORCHELASTIC_RUN_ID", "TD_RESTART_COUNT")


class _Claim(NamedTuple):
    system: str
    variables: str
    world: int | None
    rank: int | None


def _number(environ: Mapping[str, str], name: str | None) -> int | None:
    text = environ.get(name, "").strip() if name else ""
    return int(text) if text.isdigit() else None


def _others(environ: Mapping[str, str]) -> list[_Claim]:
    """What each system other than torchrun's variables says about this process."""
    claims = []
    mpi = mpi_rank_and_size(environ)
    if mpi is not None:
        family, rank, size = mpi
        names: tuple[str, ...] = (
            ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE") if family == "Open MPI" else ("PMI_RANK", "PMI_SIZE"))
        claims.append(_Claim(f"{family}'s ranks", seen_variables(environ, names), size, rank))
    if in_srun_step(environ):
        tasks = first_env(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        names = ("SLURM_PROCID",) + ((tasks[0],) if tasks else ())
        claims.append(_Claim("SLURM's step", seen_variables(environ, names),
                             _number(environ, tasks[0] if tasks else None), _number(environ, "SLURM_PROCID")))
    world = pet_world_size(environ)
    if world is not None:
        one_per_pod = environ.get("PET_NPROC_PER_NODE", "1").strip() in ("", "1")
        names = ("PET_NNODES", "PET_NPROC_PER_NODE") + (("PET_NODE_RANK",) if one_per_pod else ())
        claims.append(_Claim("Kubeflow's PET_* variables", seen_variables(environ, names), world,
                             _number(environ, "PET_NODE_RANK") if one_per_pod else None))
    return claims


def check_launchers_agree(environ: Mapping[str, str]) -> None:
    """Raise ``ClusterConfigError`` when ``RANK``/``WORLD_SIZE`` and another system's
    variables (MPI, an ``srun`` step, Kubeflow's ``PET_*``) give this process a different
    rank or world size. Nothing is compared under a per-node agent (torchrun)."""
    if any(environ.get(name) for name in _AGENT_MARKERS):
        return
    torchrun = _Claim("torchrun's variables", seen_variables(environ, ("RANK", "WORLD_SIZE")),
                      _number(environ, "WORLD_SIZE"), _number(environ, "RANK"))
    if torchrun.world is None and torchrun.rank is None:
        return
    for other in _others(environ):
        world_differs = None not in (torchrun.world, other.world) and torchrun.world != other.world
        rank_differs = None not in (torchrun.rank, other.rank) and torchrun.rank != other.rank
        if world_differs or rank_differs:
            raise ClusterConfigError(
                f"The launchers' variables disagree about this process: {torchrun.variables} "
                f"({torchrun.system}) make it {_place(torchrun)}, but {other.variables} "
                f"({other.system}) make it {_place(other)}. Keep only the variables of the system "
                "that starts the workers (RANK and WORLD_SIZE exported in a script are the same for "
                "every task: unset them, or set them per task)"
            )


def _place(claim: _Claim) -> str:
    rank = "?" if claim.rank is None else str(claim.rank)
    world = "?" if claim.world is None else str(claim.world)
    return f"worker {rank} of {world}"
