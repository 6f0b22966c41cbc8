"""``TorchrunClusterResolver``: the environment ``torchrun`` gives each worker.

It applies (``is_present``) when ``RANK`` or ``WORLD_SIZE`` is set, as under ``torchrun``,
``torch-distribute launch`` (its default ``--env torchrun``), Kubeflow's PyTorchJob, Ray Train
and ``accelerate launch``; the four of ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` must then all be set (``WORLD_SIZE=1`` may leave out the address).

>>> env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
>>> TorchrunClusterResolver.is_present(env)
True
>>> r = TorchrunClusterResolver(environ=env)
>>> r.num_workers, r.is_chief, r.rendezvous_address()
(2, True, ('node0', 29500))
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping

from torch_distribute.cluster.base import ClusterResolver, ConfigFields
from torch_distribute.cluster.cluster_spec import ClusterSpec, split_address
from torch_distribute.cluster.env import env_int, environ_or_default, seen_variables
from torch_distribute.errors import ClusterConfigError

__all__ = ["TorchrunClusterResolver"]


def _format_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


def _check_complete(env: Mapping[str, str]) -> None:
    """``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` come together (a job of
    one worker may leave out the address); otherwise a ``ClusterConfigError`` naming what was
    seen and what is missing, never a worker that silently trains alone."""
    present = {name for name in _REQUIRED if env.get(name, "").strip()}
    world = env.get("WORLD_SIZE", "").strip()
    needed = ("RANK", "WORLD_SIZE") if world == "1" else _REQUIRED
    missing = [name for name in needed if name not in present]
    if not missing:
        return
    raise ClusterConfigError(
        f"torchrun's variables are incomplete (seen: {seen_variables(env, _REQUIRED + _OPTIONAL)}): "
        f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing. A multi-worker job "
        "needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in every worker (torchrun and "
        "torch-distribute launch set them all); for a single-process run, unset "
        f"{' and '.join(sorted(present & {'RANK', 'WORLD_SIZE'}))}"
    )


_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_OPTIONAL = ("LOCAL_RANK", "LOCAL_WORLD_SIZE")


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
        ClusterConfigError: a variable missing or not a valid number (``RANK`` outside
            ``0..WORLD_SIZE-1``, ``MASTER_PORT`` outside 1..65535), or a ``MASTER_ADDR`` that
            is not a host name or IP address, naming it.

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
        env = self.environ
        _check_complete(env)
        self._world_size = env_int(env, "WORLD_SIZE", minimum=1, hint=self._HINT)
        self._rank = env_int(env, "RANK", minimum=0, hint=self._HINT)
        if self._rank >= self._world_size:
            raise ClusterConfigError(
                f"RANK={self._rank} must be below WORLD_SIZE={self._world_size}"
            )
        self._local_world_size = env_int(env, "LOCAL_WORLD_SIZE", default=1, minimum=1)
        self._local_rank = env_int(env, "LOCAL_RANK", default=0, minimum=0)
        if "LOCAL_WORLD_SIZE" in env and self._local_rank >= self._local_world_size:
            raise ClusterConfigError(
                f"LOCAL_RANK={self._local_rank} must be below "
                f"LOCAL_WORLD_SIZE={self._local_world_size}"
            )
        raw_addr = env.get("MASTER_ADDR", "")
        master_addr = raw_addr.strip()
        self._master_addr: str | None = None
        if not master_addr and self._world_size == 1:
            return  # a job of one worker: nobody has to find it
        if not master_addr:
            raise ClusterConfigError(f"environment variable MASTER_ADDR is not set{self._HINT}")
        if master_addr.startswith("[") and master_addr.endswith("]"):
            master_addr = master_addr[1:-1]
        if ":" in master_addr and not _is_ipv6(master_addr):
            raise ClusterConfigError(
                f"MASTER_ADDR={raw_addr!r} is not a host name or IP address; it must not "
                "include the port (set the port in MASTER_PORT) or a scheme such as 'tcp://'"
            )
        self._master_port = env_int(env, "MASTER_PORT", minimum=1, maximum=65535, hint=self._HINT)
        # The one check of an address (host and port), as for every other resolver.
        self._master_addr, _ = split_address(
            _format_host_port(master_addr, self._master_port),
            what="MASTER_ADDR:MASTER_PORT",
        )

    @classmethod
    def is_present(cls, environ: Mapping[str, str] | None = None) -> bool:
        """True when ``RANK`` or ``WORLD_SIZE`` is set: a launcher of torchrun's kind started
        this process (the constructor reports what else is missing)."""
        env = environ_or_default(environ)
        return any(env.get(name, "").strip() for name in ("RANK", "WORLD_SIZE"))

    def cluster_spec(self) -> ClusterSpec:
        if self._master_addr is None:
            return ClusterSpec({})
        first = _format_host_port(self._master_addr, self._master_port)
        return ClusterSpec({"worker": [first] + [f"rank{i}" for i in range(1, self._world_size)]})

    def config_fields(self) -> ConfigFields:
        """``RANK`` is this task's index; the cluster's entries past rank 0 are placeholders,
        not addresses (``MASTER_ADDR``/``MASTER_PORT`` were checked when it was built)."""
        return ConfigFields(cluster="torchrun's cluster", task_type="task_type",
                            task_id="RANK", check_addresses=False)

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
        """``(MASTER_ADDR, MASTER_PORT)`` (any free local port for a job of one worker
        without ``MASTER_ADDR``)."""
        self.validate()
        if self._master_addr is None:
            return super().rendezvous_address()
        return self._master_addr, self._master_port
