"""What ``torch-distribute launch`` starts: its arguments, their checks, each worker's env.

``LaunchSpec`` holds one launch (the script and ``--nproc``, ``--nnodes``, ...);
``validate()`` rejects bad arguments before any process starts and ``tasks(attempt)``
gives the ``TaskSpec`` of every local worker for one attempt, which
:mod:`torch_distribute.cluster.supervisor` runs. ``build_parser()`` is the command line.

Environment of local worker ``i`` (``--env torchrun``, the default)::

    RANK = node_rank * nproc + i     WORLD_SIZE = nnodes * nproc
    LOCAL_RANK = i                   LOCAL_WORLD_SIZE = nproc
    GROUP_RANK = node_rank           GROUP_WORLD_SIZE = nnodes
    MASTER_ADDR, MASTER_PORT         TD_RESTART_COUNT, TD_MAX_RESTARTS
    PYTHONUNBUFFERED = 1             OMP_NUM_THREADS = 1 (only if unset and nproc > 1)
    TD_JOB_SECRET, TD_JOB_ID         (one node, unless TD_JOB_SECRET[_FILE] is set: fresh each attempt)

A job across nodes needs the user's job secret (``TD_JOB_SECRET_FILE`` or ``TD_JOB_SECRET``,
the same on every node; see docs/security.md): ``validate`` refuses to start one without
it unless ``TD_INSECURE=1``.

With ``--min-workers N`` the job is fault-tolerant (``td.experimental.FaultTolerance``): each
worker also gets ``TD_FT_LIGHTHOUSE`` (the lighthouse's address), ``TD_FT_MIN_WORKERS`` and
``TD_FT_JOINED_FILE`` (created by the worker once it has joined a quorum), and a lost worker
is replaced alone (``fault_tolerant_tasks``).

With ``--env tf_config`` (one node only) the torchrun variables are replaced by
``TF_CONFIG = {"cluster": {"worker": ["127.0.0.1:p0", ...]}, "task": {"type": "worker",
"index": i}}``. An inherited ``TF_CONFIG`` is removed in torchrun mode (it would take
precedence in the strategy's resolution order) and inherited torchrun variables are
removed in tf_config mode.

>>> envs = worker_environments(2, nnodes=2, node_rank=1, master="node0:29500")
>>> [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["MASTER_ADDR"]) for e in envs]
[('2', '0', '4', 'node0'), ('3', '1', '4', 'node0')]
>>> [t.prefix for t in LaunchSpec(["-m", "pkg.train"], 2).tasks(0)]
['[rank 0] ', '[rank 1] ']
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from torch_distribute.cluster.cluster_spec import split_address
from torch_distribute.cluster.supervisor import TaskSpec
from torch_distribute.collectives import job_secret
from torch_distribute.collectives.fault_tolerant_group import (
    ENV_JOINED_FILE,
    ENV_LIGHTHOUSE,
    ENV_MIN_WORKERS,
)
from torch_distribute.errors import ClusterConfigError, InvalidArgumentError

__all__ = [
    "ENV_MODES",
    "PROG",
    "TORCHRUN_VARS",
    "LaunchSpec",
    "base_environment",
    "build_parser",
    "free_ports",
    "parse_master",
    "validate_launch_args",
    "worker_environments",
]

PROG = "torch-distribute launch"
ENV_MODES = ("torchrun", "tf_config")

# Variables the launcher owns in torchrun mode; removed from the inherited environment in
# tf_config mode so the strategy does not mistake the job for a torchrun job.
TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def parse_master(master: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6addr]:port"``) → ``(host, port)``; clear error otherwise.

    The address is checked by ``cluster_spec.split_address``, as every cluster address is.

    Raises:
        InvalidArgumentError: naming ``--master`` and what is wrong with it.

    >>> parse_master("[::1]:1234")
    ('::1', 1234)
    """
    if not isinstance(master, str):
        raise InvalidArgumentError(
            f"--master must be a 'HOST:PORT' string, got {type(master).__name__}: {master!r}"
        )
    try:
        return split_address(master.strip(), what="--master")
    except ClusterConfigError as error:
        raise InvalidArgumentError(f"--master must be HOST:PORT (e.g. node0:29500): {error}") from None


_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST_PICKED_PORT = 10000


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that were free on ``host`` a moment ago.

    Where the kernel says which ports it hands out for outgoing connections (Linux), they are
    picked at random below that range: a port from that range (what binding port 0 gives)
    can be taken, before the worker binds it, as the local port of any connection another
    process opens, which happens on a busy machine. Elsewhere, or if no port below the range
    is free, the kernel picks (port 0). All sockets are held open until every port is picked,
    so the ports are distinct; another program may still bind one before the worker does (as
    with torchrun's).

    >>> a, b = free_ports(2)
    >>> a != b
    True
    """
    sockets: list[socket.socket] = []
    try:
        candidates = _ports_below_ephemeral_range()
        while len(sockets) < count:
            port = candidates.pop() if candidates else 0
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                if port == 0:
                    raise
                continue
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _ports_below_ephemeral_range(tries: int = 64) -> list[int]:
    """Up to ``tries`` random ports between 10000 and the ephemeral range ([] if unknown)."""
    try:
        with open(_EPHEMERAL_RANGE) as f:
            lowest_ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return []
    if lowest_ephemeral - _LOWEST_PICKED_PORT < 1000:
        return []
    rng = random.SystemRandom()  # not the random module's state, which forked workers share
    return [rng.randrange(_LOWEST_PICKED_PORT, lowest_ephemeral) for _ in range(tries)]


def validate_launch_args(
    argv: Sequence[str],
    nproc: int,
    nnodes: int,
    node_rank: int,
    master: str | None,
    max_restarts: int,
    env_mode: str,
    grace_period: float,
    timeout: float | None,
    min_workers: int | None = None,
    lighthouse: str | None = None,
) -> None:
    """Raise ``InvalidArgumentError`` (naming the option) for any bad launch argument."""
    if isinstance(argv, str):
        raise InvalidArgumentError("the command must be a list such as ['train.py', '--lr', '0.1']")
    if not argv:
        raise InvalidArgumentError("no script given: expected `script.py [args...]` or `-m module`")
    if argv[0] == "-m":
        if len(argv) < 2 or not argv[1] or argv[1].startswith("-"):
            raise InvalidArgumentError("-m needs a module name, e.g. `-m mypackage.train`")
    elif not os.path.exists(argv[0]):
        raise InvalidArgumentError(f"script not found: {argv[0]!r} (cwd {os.getcwd()})")
    for name, value in (("nproc", nproc), ("nnodes", nnodes), ("node_rank", node_rank),
                        ("max_restarts", max_restarts)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentError(f"{name} must be an integer (got {value!r})")
    if nproc < 1:
        raise InvalidArgumentError(f"--nproc must be >= 1 (got {nproc})")
    if nnodes < 1:
        raise InvalidArgumentError(f"--nnodes must be >= 1 (got {nnodes})")
    if not 0 <= node_rank < nnodes:
        raise InvalidArgumentError(
            f"--node-rank must be in 0..{nnodes - 1} for --nnodes {nnodes} (got {node_rank})"
        )
    if nnodes > 1 and not master:
        raise InvalidArgumentError(
            f"--master HOST:PORT is required with --nnodes {nnodes} (the address of node 0, "
            "where rank 0 hosts the rendezvous store)"
        )
    if master:
        parse_master(master)
    if max_restarts < 0:
        raise InvalidArgumentError(f"--max-restarts must be >= 0 (got {max_restarts})")
    if env_mode not in ENV_MODES:
        raise InvalidArgumentError(f"--env must be one of {', '.join(ENV_MODES)} (got {env_mode!r})")
    if env_mode == "tf_config" and nnodes > 1:
        raise InvalidArgumentError(
            "--env tf_config works on one node only; for several nodes use --env torchrun or "
            "write a TF_CONFIG per process yourself"
        )
    if not grace_period >= 0:
        raise InvalidArgumentError(f"--grace-period must be >= 0 seconds (got {grace_period})")
    if timeout is not None and not timeout > 0:
        raise InvalidArgumentError(f"timeout must be > 0 seconds (got {timeout})")
    if min_workers is not None:
        if isinstance(min_workers, bool) or not isinstance(min_workers, int) or not 1 <= min_workers <= nnodes * nproc:
            raise InvalidArgumentError(
                f"--min-workers must be between 1 and the job's {nnodes * nproc} workers (got {min_workers!r})")
        if nnodes > 1 and node_rank > 0 and not lighthouse and not master:
            raise InvalidArgumentError("--min-workers across nodes needs --master (node 0 runs the lighthouse)")
    if lighthouse is not None:
        if min_workers is None:
            raise InvalidArgumentError("--lighthouse is for a fault-tolerant job: give --min-workers too")
        parse_master(lighthouse.split("://", 1)[-1])


def worker_environments(
    nproc: int,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    master: str | None = None,
    env_mode: str = "torchrun",
    restart_count: int = 0,
    max_restarts: int = 0,
) -> list[dict[str, str]]:
    """The variables the launcher sets for each local worker (one dict per local rank).

    Picks fresh free ports when no ``master`` is given, so every call (every restart
    attempt) gets a new rendezvous port.
    """
    common = {
        "TD_RESTART_COUNT": str(restart_count),
        "TD_MAX_RESTARTS": str(max_restarts),
        "PYTHONUNBUFFERED": "1",
    }
    if env_mode == "tf_config":
        ports = free_ports(nproc)
        workers = [f"127.0.0.1:{p}" for p in ports]
        return [
            {
                **common,
                "TF_CONFIG": json.dumps(
                    {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}
                ),
            }
            for i in range(nproc)
        ]
    if master:
        addr, port = parse_master(master)
    else:
        addr, port = "127.0.0.1", free_ports(1)[0]
    world = nnodes * nproc
    return [
        {
            **common,
            "RANK": str(node_rank * nproc + i),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(i),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": str(node_rank),
            "GROUP_WORLD_SIZE": str(nnodes),
            "ROLE_RANK": str(node_rank * nproc + i),
            "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(port),
        }
        for i in range(nproc)
    ]


def base_environment(
    env_mode: str, nproc: int, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The inherited environment (default ``os.environ``) cleaned for ``env_mode``."""
    env = dict(os.environ if environ is None else environ)
    if env_mode == "torchrun":
        env.pop("TF_CONFIG", None)
    else:
        for name in TORCHRUN_VARS:
            env.pop(name, None)
    if nproc > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun does: no oversubscription
    return env


@dataclass(frozen=True)
class LaunchSpec:
    """One launch: the script or module with its arguments, and the launcher's options.

    See ``torch_distribute.cluster.launcher.launch`` for the meaning of each field.
    """

    argv: Sequence[str]
    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    master: str | None = None
    max_restarts: int = 0
    env_mode: str = "torchrun"
    extra_env: Mapping[str, str] = field(default_factory=dict)
    grace_period: float = 10.0
    timeout: float | None = None
    min_workers: int | None = None
    lighthouse: str | None = None

    def validate(self) -> None:
        """Raise ``InvalidArgumentError`` for a bad argument, before any process starts."""
        validate_launch_args(self.argv, self.nproc, self.nnodes, self.node_rank, self.master,
                             self.max_restarts, self.env_mode, self.grace_period, self.timeout,
                             self.min_workers, self.lighthouse)
        environ = {**os.environ, **{k: str(v) for k, v in self.extra_env.items()}}
        try:
            if self.nnodes > 1:
                job_secret.required_secret(parse_master(self.master or "")[0],
                                           f"A job of {self.nnodes} nodes", environ)
            else:
                job_secret.job_secret(environ)  # a secret file others may read is refused now
        except ClusterConfigError as error:
            raise InvalidArgumentError(str(error)) from None

    def tasks(self, attempt: int) -> list[TaskSpec]:
        """Every local worker of attempt ``attempt`` (0 first), with fresh ports."""
        base = base_environment(self.env_mode, self.nproc)
        per_worker = worker_environments(
            self.nproc,
            nnodes=self.nnodes,
            node_rank=self.node_rank,
            master=self.master,
            env_mode=self.env_mode,
            restart_count=attempt,
            max_restarts=self.max_restarts,
        )
        extra = {k: str(v) for k, v in self.extra_env.items()}
        if self.nnodes == 1 and job_secret.job_secret({**base, **extra}) is None:
            # The workers of one node share a fresh secret and job id per attempt.
            base = {**base, job_secret.ENV_SECRET: job_secret.new_secret(),
                    "TD_JOB_ID": secrets.token_hex(8)}
        command = [sys.executable, "-u", *self.argv]
        tasks = []
        for local_rank, variables in enumerate(per_worker):
            rank = self.node_rank * self.nproc + local_rank
            tasks.append(TaskSpec(name=f"worker rank {rank}", prefix=f"[rank {rank}] ",
                                  command=command, env={**base, **variables, **extra}))
        return tasks


    # -- a fault-tolerant job (--min-workers) ------------------------------------------
    def lighthouse_address(self) -> tuple[str, bool]:
        """``host:port`` of the job's lighthouse, and whether this launcher starts it (one
        node: 127.0.0.1 and a free port; across nodes: node 0, at ``--master``'s host and
        the next port)."""
        if self.lighthouse:
            return self.lighthouse.split("://", 1)[-1], False
        if self.nnodes == 1:
            return f"127.0.0.1:{free_ports(1)[0]}", True
        host, port = parse_master(self.master or "")
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{port + 1}", self.node_rank == 0

    def fault_tolerant_tasks(self, lighthouse: str, state_dir: str) -> Callable[[int, int], TaskSpec]:
        """``task(index, generation)``: local worker ``index``, started the ``generation``-th
        time (0 first; a replacement has the same rank, secret and job id)."""
        base = base_environment(self.env_mode, self.nproc)
        per_worker = worker_environments(self.nproc, nnodes=self.nnodes, node_rank=self.node_rank,
                                         master=self.master, env_mode=self.env_mode)
        extra = {k: str(v) for k, v in self.extra_env.items()}
        if self.nnodes == 1 and job_secret.job_secret({**base, **extra}) is None:
            base = {**base, job_secret.ENV_SECRET: job_secret.new_secret(), "TD_JOB_ID": secrets.token_hex(8)}
        base = {**base, ENV_LIGHTHOUSE: f"http://{lighthouse}", ENV_MIN_WORKERS: str(self.min_workers)}
        command = [sys.executable, "-u", *self.argv]

        def task(index: int, generation: int) -> TaskSpec:
            rank = self.node_rank * self.nproc + index
            joined = os.path.join(state_dir, f"rank{rank}-{generation}.joined")
            env = {**base, **per_worker[index], "TD_RESTART_COUNT": str(generation),
                   ENV_JOINED_FILE: joined, **extra}
            return TaskSpec(name=f"worker rank {rank}", prefix=f"[rank {rank}] ", command=command, env=env)

        return task


def _pet_defaults(environ: Mapping[str, str]) -> dict[str, object]:
    """Option defaults from Kubeflow's ``PET_*`` variables, as torchrun takes them (only
    plain numbers: an elastic ``PET_NNODES`` or ``PET_NPROC_PER_NODE=auto`` need torchrun).

    >>> _pet_defaults({"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "pod0"})
    {'nnodes': 2, 'node_rank': 1, 'master': 'pod0:29500'}
    """
    defaults: dict[str, object] = {}
    for option, name in (("nproc", "PET_NPROC_PER_NODE"), ("nnodes", "PET_NNODES"), ("node_rank", "PET_NODE_RANK")):
        text = environ.get(name, "").strip()
        if text.isdigit():
            defaults[option] = int(text)
    host = environ.get("PET_MASTER_ADDR", "").strip()
    if host:
        port = environ.get("PET_MASTER_PORT", "").strip() or "29500"
        defaults["master"] = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    return defaults


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The ``torch-distribute launch`` command line.

    ``--nproc``, ``--nnodes``, ``--node-rank`` and ``--master`` default to Kubeflow's
    ``PET_NPROC_PER_NODE``, ``PET_NNODES``, ``PET_NODE_RANK`` and
    ``PET_MASTER_ADDR:PET_MASTER_PORT`` where ``environ`` (default ``os.environ``) has them.
    """
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Start local worker processes of a training script with the environment "
        "torch-distribute strategies read, prefix their output with their rank, and stop "
        "them all when one fails.",
        epilog="Everything after the script (or -m module) is passed to the script.",
    )
    parser.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", type=int, default=1,
                        metavar="N", help="worker processes on this node (default 1)")
    parser.add_argument("--nnodes", type=int, default=1, metavar="M",
                        help="number of nodes (default 1)")
    parser.add_argument("--node-rank", "--node_rank", type=int, default=0, metavar="R",
                        help="rank of this node, 0..M-1 (default 0)")
    parser.add_argument("--master", default=None, metavar="HOST:PORT",
                        help="rendezvous address (node 0); required when --nnodes > 1; "
                        "default on one node: 127.0.0.1 and a free port per attempt")
    parser.add_argument("--max-restarts", "--max_restarts", type=int, default=None, metavar="K",
                        help="restart all local workers up to K times after a failure (default 0)")
    parser.add_argument("--env", choices=ENV_MODES, default="torchrun", dest="env_mode",
                        help="how workers learn the cluster: torchrun variables (default) or "
                        "a TF_CONFIG per worker (one node only)")
    parser.add_argument("--grace-period", "--grace_period", type=float, default=10.0,
                        metavar="S", help="seconds between SIGTERM and SIGKILL (default 10)")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="stop everything and exit 124 after S seconds (default: none)")
    parser.add_argument("--min-workers", "--min_workers", type=int, default=None, metavar="N",
                        help="a fault-tolerant job (td.experimental.FaultTolerance): start its lighthouse, "
                             "replace a lost worker alone while the others go on, never run a step with "
                             "fewer than N workers; --max-restarts then counts replacements (default: no limit)")
    parser.add_argument("--lighthouse", default=None, metavar="HOST:PORT",
                        help="with --min-workers: use this running lighthouse (torch-distribute lighthouse) "
                             "instead of starting one")
    parser.add_argument("--start-method", choices=("fresh", "forkserver", "preloaded"), default=None,
                        help="fresh: a new interpreter for each worker, as torchrun starts them; "
                             "forkserver: fork the workers from Python's forkserver, which imported "
                             "torch once, so that starts and restarts skip its import; preloaded: "
                             "the old name of forkserver (default: $TD_START_METHOD, else fresh)")
    parser.add_argument("-m", "--module", action="store_true",
                        help="run the target as a module, like python -m")
    parser.add_argument("script", metavar="script.py | module",
                        help="the training script (or module name with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="args",
                        help="arguments for the script")
    parser.set_defaults(**_pet_defaults(os.environ if environ is None else environ))
    return parser
