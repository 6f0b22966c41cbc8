"""``FaultTolerantGroup``: the workers of a fault-tolerant job, whose membership changes between steps.

The engine is torchft (``pip install "torch-distribute[ft]"``): each worker runs a torchft
``Manager`` (a replica group of one process), the job's lighthouse forms a *quorum* of the
live workers at every step, and the Gloo process group is made again for each new quorum
(``authenticated_gloo``: every member proves the job secret first). A
worker behind the others (a replacement, or one that was stopped) receives the current
state from an up-to-date peer over that process group (torchft's ``PGTransport``), inside
the quorum call, before the step runs. Nothing here is a consensus of its own: who is in a
step, who heals from whom and whether a step commits are torchft's decisions.

One step, as every worker sees it:

1. ``begin_step()``: the quorum (``Manager.start_quorum``, synchronous). ``rank`` and
   ``world_size`` are now this step's: the live workers, in the order of their *slots*
   (the worker index each was started with; ``participants`` lists them). A worker behind
   the quorum's newest step has been given that step's state by now.
2. The step's collectives, with the same names and signatures as ``WorkerGroup``'s. The
   first one that fails (a member was lost: killed, stopped past ``timeout``, preempted)
   is recorded with torchft (``report_error``), and from then on every collective of the
   step returns at once with this worker's own value: nothing waits for the lost member
   again, and nothing of this step will be committed (``step_failed``).
3. ``should_commit()``: torchft's decision (no failure here, and at least ``min_workers``
   in the quorum). Only then does the caller apply the optimizer step; the committed step
   count (``committed_step``) goes up by one.

``begin_step`` waits at most ``quorum_timeout`` for ``min_workers`` live workers, then
raises ``NotEnoughWorkersError``. A lighthouse that cannot be reached raises
``FaultToleranceError`` when the group is made.

>>> ENV_LIGHTHOUSE, replica_name(2)
('TD_FT_LIGHTHOUSE', 'td00002')
"""

from __future__ import annotations

import datetime
import importlib.util
import logging
import os
import pickle
import struct
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, BroadcastOptions

from torch_distribute.collectives import exchange, fingerprint, job_auth
from torch_distribute.collectives.failure_kind import FailureKind, failure_kind
from torch_distribute.collectives.packing import apply_packed_, joined_along, padded_along
from torch_distribute.errors import (
    DistributeError,
    FaultToleranceError,
    NotEnoughWorkersError,
    ReplicaMismatchError,
)
from torch_distribute.log import get_logger

__all__ = [
    "ENV_JOINED_FILE",
    "ENV_LIGHTHOUSE",
    "ENV_MIN_WORKERS",
    "LEFT_FOR_PREEMPTION",
    "FaultTolerantGroup",
    "StepAgreement",
    "replica_name",
    "require_torchft",
]

#: Where the lighthouse listens (``http://host:port``), set by ``torch-distribute launch``.
ENV_LIGHTHOUSE = "TD_FT_LIGHTHOUSE"
#: The ``min_workers`` the launcher started the lighthouse with.
ENV_MIN_WORKERS = "TD_FT_MIN_WORKERS"
#: A file the worker creates once it has joined a quorum (set by the launcher, which stops a
#: replacement that had not joined when the job finished).
ENV_JOINED_FILE = "TD_FT_JOINED_FILE"
#: The exit status of a worker that left its job after a SIGTERM (128 + SIGTERM, as a process
#: killed by it reports): ``torch-distribute launch`` starts a replacement.
LEFT_FOR_PREEMPTION = 143
_TORCHFT_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"  # torchft's own name for it, read as a fallback
_TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")

_log = get_logger("fault_tolerance")


def require_torchft() -> None:
    """Raise ``FaultToleranceError`` saying what to install when torchft is missing.

    It also quiets torchft before its first import, where the user has not configured it:
    its Rust side logs every quorum at INFO on stderr (``RUST_LOG``), its Python loggers a
    traceback for every lost worker; this package logs one line instead.
    """
    if importlib.util.find_spec("torchft") is None:
        raise FaultToleranceError(
            "Per-step fault tolerance (td.experimental.FaultTolerance) runs on torchft, which is not "
            "installed: pip install 'torch-distribute[ft]' (torchft 0.2 needs torch>=2.7 and has wheels for "
            "CPython 3.11 on Linux x86-64), or leave "
            "fault_tolerance out to restart the whole job from a checkpoint after a failure "
            "(td.BackupAndRestore).")
    if tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < (2, 7):
        raise FaultToleranceError(
            f"Per-step fault tolerance runs on torchft, which needs torch>=2.7; this is torch "
            f"{torch.__version__}. Upgrade torch, or leave fault_tolerance out.")
    os.environ.setdefault("RUST_LOG", "error")
    for name in _TORCHFT_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.CRITICAL)


def replica_name(slot: int) -> str:
    """The torchft replica id of worker ``slot``: sorts (and so ranks) in slot order, and
    ends in the slot's digits (torchft reads them back as the member's global rank)."""
    return f"td{slot:05d}"


def lighthouse_address(given: str | None) -> str:
    """``given``, else ``TD_FT_LIGHTHOUSE``, else ``TORCHFT_LIGHTHOUSE``; ``FaultToleranceError``
    when none is set."""
    address = given or os.environ.get(ENV_LIGHTHOUSE) or os.environ.get(_TORCHFT_LIGHTHOUSE)
    if not address:
        raise FaultToleranceError(
            "A fault-tolerant job needs a lighthouse (torchft's quorum server) and none is known: start "
            "the job with torch-distribute launch --min-workers N (it starts one), or start one yourself "
            "(torch-distribute lighthouse --min-workers N) and give every worker its address in "
            f"{ENV_LIGHTHOUSE}=http://host:port, or pass FaultTolerance(lighthouse=...).")
    return address if "://" in address else f"http://{address}"


@dataclass(frozen=True)
class StepAgreement:
    """A fingerprint exchange in flight (``start_agreement``)."""

    work: Any
    gathered: torch.Tensor
    head: bytes
    what: str


class FaultTolerantGroup:
    """This worker's membership in a fault-tolerant job (see the module docstring).

    ``slot``: this worker's index as started (``TF_CONFIG``'s, torchrun's ``RANK``); a
    replacement takes the slot of the worker it replaces. ``host``: the address the other
    workers reach this one at (its store and torchft's manager listen there).
    ``state_dict``/``load_state_dict``: what a worker behind the others receives (any nest
    of tensors and plain values), read on an up-to-date worker inside its quorum call and
    loaded on the receiver inside its own. ``timeout``: seconds a collective may wait for a
    member before that member counts as lost.

    >>> # group = FaultTolerantGroup(slot=0, host="127.0.0.1", lighthouse="http://127.0.0.1:29510",
    >>> #     min_workers=2, timeout=30, quorum_timeout=300, secret=None, verify=True,
    >>> #     state_dict=lambda: {}, load_state_dict=lambda state: None)
    """

    def __init__(self, *, slot: int, host: str, lighthouse: str, min_workers: int, timeout: float,
                 quorum_timeout: float, secret: bytes | None, verify: bool,
                 state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]) -> None:
        require_torchft()
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.manager import Manager

        from torch_distribute.collectives.authenticated_gloo import authenticated_gloo

        self.slot = slot
        self.lighthouse = lighthouse
        self.min_workers = min_workers
        self.timeout = timeout
        self.quorum_timeout = quorum_timeout
        self._verify = verify
        self._closed = False
        self.run_count = 0  # strategy.run calls since this step's quorum
        self.quorum_id = -1  # the quorum this step runs in (torchft's id; -1 before the first)
        self.participants: tuple[int, ...] = ()  # this step's workers' slots, in rank order
        self.world_size = 1  # this step's live workers (1 before the first quorum)
        self.rank = 0  # this worker's rank among them (slot order)
        self._step_open = False
        self._failure: BaseException | None = None
        delta = datetime.timedelta(seconds=timeout)
        listener = job_auth.listening_socket(host, 0)
        # The store this worker hosts: torchft's manager address lives in it, and when this
        # worker is a quorum's primary the quorum's Gloo group meets there.
        self._store: Any = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=delta,
            master_listen_fd=listener.detach() if listener is not None else None)
        self._pg = authenticated_gloo(secret, delta)
        transport = PGTransport(self._pg, timeout=delta, device=torch.device("cpu"))
        try:
            self._manager = Manager(
                pg=self._pg, load_state_dict=None, state_dict=None, min_replica_size=min_workers,
                use_async_quorum=False, timeout=delta,
                quorum_timeout=datetime.timedelta(seconds=quorum_timeout),
                connect_timeout=datetime.timedelta(seconds=min(timeout, 30.0)),
                rank=0, world_size=1, store_addr=host, store_port=self._store.port,
                lighthouse_addr=lighthouse, replica_id=replica_name(slot), hostname=host,
                checkpoint_transport=transport, init_sync=True)
        except Exception as error:  # torchft raises what tonic/grpc gave it
            self._store = None
            raise FaultToleranceError(
                f"Worker {slot} could not reach the lighthouse at {lighthouse} ({error}). Is it running? "
                "torch-distribute launch --min-workers N starts one for a job on this machine.") from error
        self._manager.register_state_dict_fn("torch_distribute", load_state_dict, state_dict)

    # -- the step ------------------------------------------------------------------------
    @property
    def committed_step(self) -> int:
        """Steps committed by the job so far (a healed worker's count is its source's)."""
        return int(self._manager.current_step())

    @property
    def step_open(self) -> bool:
        """Whether a quorum was made and its step was not closed yet (``should_commit`` or
        ``close_step``); a step whose collectives failed stays open until closed."""
        return self._step_open

    @property
    def step_failed(self) -> bool:
        """Whether a collective of this step failed (nothing of it will be committed)."""
        return self._failure is not None or self._manager.errored() is not None

    def begin_step(self) -> None:
        """Make this step's quorum (healing this worker first if it is behind).

        Raises ``NotEnoughWorkersError`` when fewer than ``min_workers`` are live for
        ``quorum_timeout`` seconds.
        """
        self._failure = None
        self.run_count = 0
        deadline = time.monotonic() + self.quorum_timeout
        while True:
            left = deadline - time.monotonic()
            try:
                with warnings.catch_warnings():
                    # torchft's state transfer: a read-only buffer wrapped, a pytree deprecation.
                    warnings.simplefilter("ignore", UserWarning)
                    warnings.simplefilter("ignore", FutureWarning)
                    self._manager.start_quorum(timeout=datetime.timedelta(seconds=max(left, 0.1)))
            except DistributeError:
                raise  # ours, from inside the quorum (the received state refused, say): as it is
            except Exception as error:
                # The lighthouse's answer that no quorum formed in time is a timeout; anything
                # else (a broken connection, a failed state transfer) is named as it is.
                timed_out = failure_kind(error) is FailureKind.TIMED_OUT or time.monotonic() >= deadline
                if not timed_out:
                    raise FaultToleranceError(
                        f"Worker {self.slot} could not make the quorum of step {self.committed_step + 1}: "
                        f"{_first_line(error)}. The lighthouse at {self.lighthouse}, or the peer sending this "
                        "worker the job's state, failed: see the log above.") from error
                raise self._too_few(str(error)) from error
            size = int(self._manager.num_participants())
            if size >= self.min_workers:
                break
            # A lighthouse started with a lower min_workers than this one: such a step could
            # never commit. Ask again until enough workers are live.
            if time.monotonic() >= deadline:
                raise self._too_few(f"the quorum had {size}")
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        self._step_open = True
        self.world_size = max(1, int(self._manager.num_participants()))
        self.rank = int(self._manager.participating_rank() or 0)
        self.quorum_id = self._pg.quorum_id
        self.participants = self._pg.members
        if self._manager.errored() is not None:
            self._failure = self._manager.errored()
            _log.warning("worker %d: the quorum of step %d could not be set up (%s); the step will not "
                         "be committed", self.slot, self.committed_step + 1, _first_line(self._failure))

    def _too_few(self, detail: str) -> NotEnoughWorkersError:
        return NotEnoughWorkersError(
            f"Worker {self.slot} waited {self.quorum_timeout:g} s for a quorum of at least {self.min_workers} "
            f"live workers and none formed ({detail}). Start replacements for the lost workers sooner "
            "(torch-distribute launch --min-workers restarts them), lower min_workers, or raise "
            "FaultTolerance(quorum_timeout=...).")

    def should_commit(self) -> bool:
        """torchft's decision for this step: True (and ``committed_step`` + 1) when no
        member failed and the quorum has ``min_workers``."""
        committed = bool(self._manager.should_commit())
        self._step_open = False
        return committed

    def close_step(self) -> None:
        """Close the step without a commit (one that failed before any optimizer step)."""
        self._step_open = False

    def _failed(self, what: str, error: BaseException) -> None:
        if self._failure is None:
            _log.warning("worker %d lost a member during %s of step %d (%s); the step will not be "
                         "committed and the next one runs with the workers left", self.slot, what,
                         self.committed_step + 1, _first_line(error))
        self._failure = error
        self._manager.report_error(error if isinstance(error, Exception) else RuntimeError(str(error)))

    def _run(self, what: str, start: Callable[[], Any]) -> bool:
        """Start a collective and wait for it; False (and the step marked failed) if it fails
        or the step failed already."""
        if self.step_failed:
            return False
        try:
            work = start()
            work.wait(datetime.timedelta(seconds=self.timeout))
        except Exception as error:  # Gloo's connection resets and timeouts, a broken group
            self._failed(what, error)
            return False
        return True

    # -- what GradientSynchronizer and the strategies ask of a group -------------------
    @property
    def verifies_collectives(self) -> bool:
        return self._verify

    @property
    def collectives_failed(self) -> bool:
        """Whether this step's results are this worker's own (a member was lost)."""
        return self.step_failed

    @property
    def store(self) -> None:
        """No store every worker reaches for the whole job (the quorum's changes)."""
        return None

    def begin_run(self) -> None:
        self.run_count += 1

    def step_label(self, optimizer_steps: int) -> tuple[int, int]:
        """(step, run) that a gradient bucket's signature and fingerprint name: the job's
        next committed step and the run since the quorum, the same on a worker that just
        joined (``optimizer_steps``, this process's own count, is not)."""
        return self.committed_step + 1, self.run_count

    def agree(self, kind: str, what: str, tensor: torch.Tensor | None = None,
              shape: Sequence[int] | None = None) -> None:
        agreement = self.start_agreement(kind, what, tensor, shape)
        if agreement is not None:
            self.finish_agreement(agreement)

    def start_agreement(self, kind: str, what: str, tensor: torch.Tensor | None = None,
                        shape: Sequence[int] | None = None, payload: bytes = b"") -> StepAgreement | None:
        """Start the all-gather of this collective's fingerprint (None when not verifying, or
        the step failed)."""
        if (not self._verify and not payload) or self.step_failed:
            return None
        dtype = tensor.dtype if tensor is not None else None
        compared = tuple(shape) if shape is not None else (tuple(tensor.shape) if tensor is not None else None)
        head = fingerprint.encode(kind, what, dtype, compared)
        gathered = torch.empty(self.world_size, exchange.WIDTH, dtype=torch.int64)
        try:
            work = self._pg.allgather([list(gathered.unbind(0))], [exchange.pack(head, payload)], AllgatherOptions())
        except Exception as error:
            self._failed(what, error)
            return None
        return StepAgreement(work, gathered, head, what)

    def finish_agreement(self, agreement: StepAgreement) -> list[bytes] | None:
        """Every worker's payload; ``ReplicaMismatchError`` (a bug, raised on every worker)
        when they called different collectives; None when the step failed."""
        if not self._run(agreement.what, lambda: agreement.work):
            return None
        rows = exchange.rows(agreement.gathered)
        if any(head != agreement.head for head, _ in rows):
            self.raise_mismatch(agreement.what)
        return [payload for _, payload in rows]

    def raise_mismatch(self, description: str) -> NoReturn:
        calls = self.all_gather_objects(f"{description} at {fingerprint.call_site()}", "mismatched collectives")
        listing = "; ".join(f"worker {self.participants[r] if r < len(self.participants) else r}: {call}"
                            for r, call in enumerate(calls))
        raise ReplicaMismatchError(
            f"The workers called different collectives at the same point: {listing}. Every worker must "
            "make the same reductions, gathers, saves and optimizer steps, in the same order.")

    def wait(self, what: str, work: Any) -> None:
        """Wait for a collective started by ``all_reduce_async`` (nothing if it failed)."""
        if work is not None:
            self._run(what, lambda: work)

    def all_reduce_async(self, tensor: torch.Tensor) -> Any:
        """Start a SUM over this step's workers; None once the step failed."""
        if self.step_failed:
            return None
        try:
            return self._pg.allreduce([tensor], _allreduce_options(dist.ReduceOp.SUM))
        except Exception as error:
            self._failed("gradient all-reduce", error)
            return None

    def any_true(self, flag: bool, what: str) -> bool:
        agreement = self.start_agreement("any_true", what, payload=b"\x01" if flag else b"\x00")
        payloads = self.finish_agreement(agreement) if agreement is not None else None
        return flag if payloads is None else any(payload[0] for payload in payloads)

    def gather_small(self, payload: bytes, what: str) -> list[bytes]:
        """Every worker's small ``payload`` (64 bytes at most), in rank order, zero-padded; this
        worker's own alone when the step failed (nothing of the step is committed then)."""
        agreement = self.start_agreement("gather_small", what, payload=payload or b"\x00")
        payloads = self.finish_agreement(agreement) if agreement is not None else None
        return [payload.ljust(exchange.PAYLOAD_BYTES, b"\x00")] if payloads is None else payloads

    def all_reduce_(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, what: str = "all_reduce") -> torch.Tensor:
        """SUM (or ``op``) over this step's workers, in place; this worker's own value when
        the step failed."""
        if exchange.can_carry(tensor, op):
            agreement = self.start_agreement(f"all_reduce {op}", what, tensor, payload=exchange.small_values(tensor))
            payloads = self.finish_agreement(agreement) if agreement is not None else None
            if payloads is not None:
                tensor.copy_(exchange.combine(payloads, op, tensor))
            return tensor
        self.agree(f"all_reduce {op}", what, tensor)
        target = tensor.cpu() if tensor.is_cuda else tensor
        options = _allreduce_options(op)
        if self._run(what, lambda: self._pg.allreduce([target], options)) and target is not tensor:
            tensor.copy_(target)
        return tensor

    def broadcast_(self, tensor: torch.Tensor, src: int = 0, what: str = "broadcast") -> torch.Tensor:
        self.agree(f"broadcast from {src}", what, tensor)
        target = tensor.cpu() if tensor.is_cuda else tensor
        options = BroadcastOptions()
        options.rootRank = src
        if self._run(what, lambda: self._pg.broadcast([target], options)) and target is not tensor:
            tensor.copy_(target)
        return tensor

    def broadcast_packed_(self, tensors: list[torch.Tensor], src: int = 0, what: str = "broadcast") -> None:
        apply_packed_(tensors, lambda flat: self.broadcast_(flat, src=src, what=what))

    def average_packed_(self, tensors: list[torch.Tensor], what: str = "average") -> None:
        """The mean over this step's workers, in place (this worker's own when the step failed)."""
        def average(flat: torch.Tensor) -> None:
            self.all_reduce_(flat, what=what)
            if not self.step_failed:
                flat.div_(self.world_size)

        apply_packed_(tensors, average)

    def all_gather_objects(self, value: Any, what: str = "all_gather") -> list[Any]:
        """Small Python values from this step's workers, in rank order; ``[value]`` alone when
        the step failed (callers read entries by rank, and rank 0's first)."""
        data = pickle.dumps(value)
        agreement = self.start_agreement("all_gather_objects", what, payload=struct.pack("<q", len(data)))
        payloads = self.finish_agreement(agreement) if agreement is not None else None
        if payloads is None:
            return [value]
        sizes = [struct.unpack_from("<q", payload)[0] for payload in payloads]
        longest = max(sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        pieces = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
        if not self._run(what, lambda: self._pg.allgather([pieces], [mine], AllgatherOptions())):
            return [value]
        return [pickle.loads(piece[:n].numpy().tobytes()) for piece, n in zip(pieces, sizes, strict=True)]

    def all_gather_along(self, tensor: torch.Tensor, axis: int, what: str = "gather") -> torch.Tensor:
        """Concatenate ``tensor`` from this step's workers along ``axis``; this worker's own
        when the step failed."""
        off_axis = tuple(-1 if d == axis else n for d, n in enumerate(tensor.shape))
        agreement = self.start_agreement(f"all_gather along {axis}", what, tensor, off_axis,
                                         payload=struct.pack("<q", tensor.shape[axis]))
        payloads = self.finish_agreement(agreement) if agreement is not None else None
        if payloads is None:
            return tensor
        counts = [struct.unpack_from("<q", payload)[0] for payload in payloads]
        padded = padded_along(tensor, axis, max(counts)).cpu()
        pieces = [torch.empty_like(padded) for _ in counts]
        if not self._run(what, lambda: self._pg.allgather([pieces], [padded], AllgatherOptions())):
            return tensor
        return joined_along(pieces, counts, axis, tensor.device)

    # -- exit --------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the job: torchft's manager (its heartbeats, its server) and this worker's
        store stopped, the process group dropped."""
        if self._closed:
            return
        self._closed = True
        try:
            self._manager.shutdown(wait=False)
        finally:
            self._pg.shutdown()
            self._store = None


def _allreduce_options(op: Any) -> AllreduceOptions:
    options = AllreduceOptions()
    options.reduceOp = op
    return options


def _first_line(error: BaseException | None) -> str:
    text = str(error) if error is not None else ""
    return (text.strip().splitlines() or [type(error).__name__])[0][:200]
