"""``MPIClusterResolver``: the ranks ``mpirun`` / ``mpiexec`` give each process.

Open MPI sets ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE`` and
``OMPI_COMM_WORLD_LOCAL_RANK``; MPICH's Hydra and Intel MPI set ``PMI_RANK``, ``PMI_SIZE``
(and ``MPI_LOCALRANKID``). MPI hands out no address to meet at, so the rendezvous is read
from ``MASTER_ADDR``/``MASTER_PORT`` (``mpirun -x MASTER_ADDR=node0 -x MASTER_PORT=29500``):
a job of several processes without them is refused with a ``ClusterConfigError`` saying so,
rather than guessed (and this module never initializes MPI itself).

>>> env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
...        "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
>>> MPIClusterResolver.is_present(env)
True
>>> r = MPIClusterResolver(environ=env)
>>> r.num_workers, r.worker_index, r.is_chief, r.rendezvous_address()
(2, 1, False, ('node0', 29500))
"""

from __future__ import annotations

from collections.abc import Mapping

from torch_distribute.cluster.base import ClusterResolver, ConfigFields
from torch_distribute.cluster.cluster_spec import ClusterSpec, split_address
from torch_distribute.cluster.env import env_int, environ_or_default, seen_variables
from torch_distribute.cluster.slurm_batch import in_srun_step
from torch_distribute.errors import ClusterConfigError

__all__ = ["MPI_VARS", "MPIClusterResolver", "mpi_rank_and_size"]

#: (rank, size, local rank) variables of each MPI family, in the order they are looked for.
_FAMILIES = (
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("MPICH/PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
)

#: Every variable this resolver reads, for error messages.
MPI_VARS = tuple(name for family in _FAMILIES for name in family[1:]) + ("MASTER_ADDR", "MASTER_PORT")


def _family(environ: Mapping[str, str]) -> tuple[str, str, str, str] | None:
    for family in _FAMILIES:
        if any(environ.get(name, "").strip() for name in family[1:3]):
            return family
    return None


def mpi_rank_and_size(environ: Mapping[str, str]) -> tuple[str, int | None, int | None] | None:
    """``(family, rank, size)`` as MPI's variables give them (None where unset or not a
    number), or None without MPI variables.

    >>> mpi_rank_and_size({"PMI_RANK": "0", "PMI_SIZE": "4"})
    ('MPICH/PMI', 0, 4)
    """
    family = _family(environ)
    if family is None:
        return None
    name, rank_var, size_var, _ = family

    def number(var: str) -> int | None:
        text = environ.get(var, "").strip()
        return int(text) if text.isdigit() else None

    return name, number(rank_var), number(size_var)


class MPIClusterResolver(ClusterResolver):
    """Reads the rank and size ``mpirun`` gives a process, and ``MASTER_ADDR``/``MASTER_PORT``.

    Every process is a ``"worker"``; the rank is its index and rank 0 hosts the rendezvous
    at ``MASTER_ADDR:MASTER_PORT``. ``local_rank`` is ``OMPI_COMM_WORLD_LOCAL_RANK`` (or
    ``MPI_LOCALRANKID``, default 0).

    Raises:
        ClusterConfigError: naming the variables seen: a rank without a size (or the other
            way round), a rank outside the size, or more than one process without
            ``MASTER_ADDR`` (MPI gives no address; set it and ``MASTER_PORT``).

    >>> MPIClusterResolver(environ={"PMI_RANK": "0", "PMI_SIZE": "2"})
    Traceback (most recent call last):
    ...
    torch_distribute.errors.ClusterConfigError: MPI started 2 processes (seen: PMI_RANK='0', PMI_SIZE='2') but MASTER_ADDR is not set: MPI gives no address to meet at. Set MASTER_ADDR to the host of rank 0 and MASTER_PORT to a free port on it, for every process (e.g. mpirun -x MASTER_ADDR=node0 -x MASTER_PORT=29500 ...)
    """

    def __init__(
        self, *, rpc_layer: str | None = None, environ: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(rpc_layer=rpc_layer, environ=environ)
        env = self.environ
        family = _family(env)
        if family is None:
            raise ClusterConfigError(
                "no MPI variables are set (OMPI_COMM_WORLD_RANK/SIZE or PMI_RANK/SIZE): start the "
                "program with mpirun"
            )
        self.family, rank_var, size_var, local_var = family
        seen = seen_variables(env, MPI_VARS)
        missing = [name for name in (rank_var, size_var) if not env.get(name, "").strip()]
        if missing:
            raise ClusterConfigError(
                f"{self.family}'s variables are incomplete (seen: {seen}): {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} missing; mpirun sets both {rank_var} and "
                f"{size_var}"
            )
        self._size = env_int(env, size_var, minimum=1)
        self._rank = env_int(env, rank_var, minimum=0)
        if self._rank >= self._size:
            raise ClusterConfigError(f"{rank_var}={self._rank} must be below {size_var}={self._size}")
        self._local_rank = env_int(env, local_var, default=0, minimum=0)
        self._address: tuple[str, int] | None = None
        master = env.get("MASTER_ADDR", "").strip()
        if self._size > 1 and not master:
            raise ClusterConfigError(
                f"MPI started {self._size} processes (seen: {seen}) but MASTER_ADDR is not set: MPI "
                "gives no address to meet at. Set MASTER_ADDR to the host of rank 0 and MASTER_PORT "
                "to a free port on it, for every process (e.g. mpirun -x MASTER_ADDR=node0 "
                "-x MASTER_PORT=29500 ...)"
            )
        if master:
            hint = " (set it beside MASTER_ADDR: the port rank 0 listens on)"
            port = env_int(env, "MASTER_PORT", minimum=1, maximum=65535, hint=hint)
            self._address = split_address(f"{master}:{port}", what="MASTER_ADDR:MASTER_PORT")

    @classmethod
    def is_present(cls, environ: Mapping[str, str] | None = None) -> bool:
        """True when Open MPI's (``OMPI_COMM_WORLD_RANK``/``SIZE``) or PMI's
        (``PMI_RANK``/``PMI_SIZE``, outside an ``srun`` step) rank or size is set."""
        env = environ_or_default(environ)
        family = _family(env)
        # srun --mpi=pmi2 sets PMI_RANK too: there SLURM's resolver reads the step (and its
        # node list gives the address MPI does not).
        return family is not None and not (family[0] == "MPICH/PMI" and in_srun_step(env))

    def cluster_spec(self) -> ClusterSpec:
        if self._size == 1:
            return ClusterSpec({})
        assert self._address is not None  # checked when built
        host, port = self._address
        return ClusterSpec({"worker": [f"{host}:{port}"] + [f"rank{i}" for i in range(1, self._size)]})

    def config_fields(self) -> ConfigFields:
        """The MPI rank is this task's index; entries past rank 0 are placeholders."""
        return ConfigFields(cluster="MPI's cluster", task_type="task_type",
                            task_id="the MPI rank", check_addresses=False)

    def _default_task_type(self) -> str | None:
        return "worker"

    def _default_task_id(self) -> int | None:
        return self._rank

    @property
    def local_rank(self) -> int:
        """``OMPI_COMM_WORLD_LOCAL_RANK`` or ``MPI_LOCALRANKID`` (0 when unset)."""
        return self._local_rank

    def rendezvous_address(self) -> tuple[str, int]:
        """``(MASTER_ADDR, MASTER_PORT)`` (any free local port for a single process)."""
        if self._address is None:
            return super().rendezvous_address()
        return self._address
