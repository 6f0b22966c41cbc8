"""The local launcher: ``torch-distribute launch`` / ``python -m torch_distribute.launch``.

Starts ``--nproc`` worker processes of a training script on this machine with the
environment a strategy reads (torchrun's variable names, or a ``TF_CONFIG`` per process),
prefixes each worker's output lines with its rank, and supervises the workers: when one
fails, the others are stopped (SIGTERM to each worker's process group, then SIGKILL after
the grace period) and either all local workers are started again (``--max-restarts``) or
the launcher exits non-zero naming the failed worker.

    torch-distribute launch --nproc 2 train.py --epochs 3
    torch-distribute launch --nproc 4 --nnodes 2 --node-rank 0 --master node0:29500 train.py
    torch-distribute launch --nproc 2 --env tf_config -m mypackage.train
    torch-distribute launch --nproc 3 --min-workers 2 train.py   # fault-tolerant: see below

With ``--min-workers N`` the job is fault-tolerant (``td.experimental.FaultTolerance``): the
launcher runs torchft's lighthouse (``cluster/lighthouse.py``) in its own process, and a
worker that is lost (killed by a signal, or that left after SIGTERM with status 143) is
started again alone while the others go on training (``ProcessSupervisor.run_replacing``);
``--max-restarts`` then limits the replacements (default: none). A worker that fails any
other way (an exception: a bug) ends the job as usual.

The launcher does no networking of its own: the rendezvous is ``torch.distributed``'s
(worker 0 hosts the c10d store at ``MASTER_ADDR:MASTER_PORT``). Ports for a single-node
job are picked by binding port 0, fresh for every restart attempt. What each worker gets
in its environment is described in :mod:`torch_distribute.cluster.launch_spec`; the
supervision is :mod:`torch_distribute.cluster.supervisor`'s ``run_gang``.

Exit status: 0 when every worker exits 0; the failed worker's exit code (128 + signal
number when it was killed by a signal) once restarts are exhausted; 130/143 when the
launcher itself is interrupted (SIGINT/SIGTERM); 124 when the ``timeout`` passes.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import IO

from torch_distribute.cluster.launch_spec import (
    PROG,
    TORCHRUN_VARS,
    LaunchSpec,
    build_parser,
    free_ports,
    parse_master,
    worker_environments,
)
from torch_distribute.cluster.lighthouse import start_lighthouse
from torch_distribute.cluster.supervisor import EXIT_TIMEOUT, ProcessSupervisor
from torch_distribute.collectives.fault_tolerant_group import ENV_JOINED_FILE, LEFT_FOR_PREEMPTION
from torch_distribute.errors import InvalidArgumentError

__all__ = [
    "EXIT_TIMEOUT",
    "TORCHRUN_VARS",
    "free_ports",
    "launch",
    "main",
    "parse_master",
    "worker_environments",
]


def launch(
    script_or_module_argv: Sequence[str],
    nproc: int,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    master: str | None = None,
    max_restarts: int | None = None,
    env_mode: str = "torchrun",
    extra_env: Mapping[str, str] | None = None,
    grace_period: float = 10.0,
    timeout: float | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    start_method: str | None = None,
    min_workers: int | None = None,
    lighthouse: str | None = None,
) -> int:
    """Run ``nproc`` local workers of a Python script and return the launcher's exit code.

    ``script_or_module_argv`` is ``["train.py", *args]`` or ``["-m", "pkg.train", *args]``;
    each worker runs ``sys.executable -u`` with it. ``stdout``/``stderr`` (default: the
    current ``sys.stdout``/``sys.stderr``) receive the workers' lines prefixed with
    ``[rank R] ``; the launcher's own messages go to ``stderr``. ``extra_env`` is added to
    every worker's environment last. ``timeout`` (seconds, for tests) stops everything and
    returns 124 when it passes. ``start_method``: ``"fresh"`` starts a new interpreter for
    each worker, as torchrun does; ``"forkserver"`` forks them from the standard library's
    forkserver, which imported torch once (starts and restarts skip torch's import); None
    reads ``TD_START_METHOD`` (default fresh). ``min_workers``: a fault-tolerant job (see the
    module docstring); ``lighthouse``: a running lighthouse's ``host:port`` to use instead
    of starting one.

    Raises ``InvalidArgumentError`` for bad arguments, before any process starts.
    """
    argv = script_or_module_argv
    replacements = max_restarts  # a fault-tolerant job: None is no limit
    max_restarts = max_restarts or 0
    spec = LaunchSpec(
        argv=argv if isinstance(argv, str) else list(argv),
        nproc=nproc,
        nnodes=nnodes,
        node_rank=node_rank,
        master=master,
        max_restarts=max_restarts,
        env_mode=env_mode,
        extra_env=dict(extra_env or {}),
        grace_period=grace_period,
        timeout=timeout,
        min_workers=min_workers,
        lighthouse=lighthouse,
    )
    supervisor = ProcessSupervisor(  # checks start_method; starts nothing yet
        stdout=sys.stdout if stdout is None else stdout,
        stderr=sys.stderr if stderr is None else stderr,
        grace_period=float(grace_period),
        log_prefix=f"{PROG}: ",
        start_method=start_method,
    )
    spec.validate()
    with supervisor.handling_signals():
        try:
            if spec.min_workers is not None:
                return _run_fault_tolerant(spec, supervisor, replacements)
            return supervisor.run_gang(spec.tasks, max_restarts=max_restarts, timeout=timeout)
        finally:
            supervisor.kill_all()


def _run_fault_tolerant(spec: LaunchSpec, supervisor: ProcessSupervisor, replacements: int | None) -> int:
    """The lighthouse (here, unless it runs elsewhere), then the workers, each replaced alone."""
    address, starts_lighthouse = spec.lighthouse_address()
    assert spec.min_workers is not None
    try:
        # In this process: its torch is imported already, a process of its own would import it again.
        lighthouse = start_lighthouse(address, spec.min_workers) if starts_lighthouse else None
    except Exception as error:  # torchft's own error (the address is taken, say)
        supervisor.log(f"the lighthouse did not start at {address}: {error}")
        return 1
    try:
        with tempfile.TemporaryDirectory(prefix="td-ft-") as state_dir:
            return supervisor.run_replacing(
                spec.fault_tolerant_tasks(address, state_dir), spec.nproc,
                lost=_lost_not_crashed,
                joined=lambda task: os.path.exists(task.env[ENV_JOINED_FILE]),
                max_replacements=replacements, timeout=spec.timeout)
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()


def _lost_not_crashed(code: int) -> bool:
    """Whether a fault-tolerant worker that ended with ``code`` was lost (killed: SIGKILL, as a
    machine gone or the OOM killer; SIGTERM, or left for it: preempted) and gets a replacement.
    A crash (SIGSEGV, SIGABRT, SIGBUS...) or an error is the program's: it ends the job, rather
    than restarting a worker that would crash again on every start."""
    return code in (-signal.SIGKILL, -signal.SIGTERM, 128 + signal.SIGKILL, LEFT_FOR_PREEMPTION)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: parse ``argv`` (default ``sys.argv[1:]``), launch, return the code."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        target = ["-m", args.script] if args.module else [args.script]
        command = [*target, *args.script_args]
        try:
            LaunchSpec(command, args.nproc, args.nnodes, args.node_rank, args.master,
                       args.max_restarts or 0, args.env_mode, {}, args.grace_period,
                       args.timeout, args.min_workers, args.lighthouse).validate()
        except InvalidArgumentError as exc:
            parser.error(str(exc))
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return launch(
        command,
        args.nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master=args.master,
        max_restarts=args.max_restarts,
        env_mode=args.env_mode,
        grace_period=args.grace_period,
        timeout=args.timeout,
        start_method=args.start_method,
        min_workers=args.min_workers,
        lighthouse=args.lighthouse,
    )


if __name__ == "__main__":
    sys.exit(main())
