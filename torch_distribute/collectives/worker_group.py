"""``WorkerGroup``: the process-group level of the collectives, over ``torch.distributed``.

Every collective between worker processes goes through it: reductions, gathers and
broadcasts of tensors (packed ones too), the asynchronous gradient all-reduce, and small
Python objects.

Rendezvous is a c10d ``TCPStore`` hosted by the chief. Every collective has a deadline; each
worker also writes a heartbeat into the store, so when a collective fails or times out the
error names the workers that stopped answering instead of hanging or saying "timeout". Every
access to the store after start-up has a deadline too (a stopped chief accepts connections
but never answers), and every collective is first compared across workers
(``fingerprint.py``), so a program that calls different collectives on different workers
gets ``ReplicaMismatchError`` rather than mixed numbers.

The group composes one part per concern, each in its own module:

- ``group_rendezvous.Rendezvous``: meeting the workers (or adopting an existing process
  group) and making the process groups (``process_groups.ProcessGroups``);
- ``liveness.Liveness``: heartbeats, announcing departure, ``missing_workers``;
- ``store_threads.StoreThreads``: store traffic with a deadline, and its end before teardown;
- ``failure_diagnosis.FailureDiagnosis``: a failed collective turned into the error that
  names who is missing;
- ``agreement.FingerprintAgreement``: the fingerprint exchanges;
- ``group_collectives.GroupCollectives``: the collectives themselves.

This module keeps the group's public surface and its exit: announcing departure, keeping a
failed chief's store up until the others left, and closing before the interpreter's teardown.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from torch_distribute.collectives.agreement import Agreement, FingerprintAgreement
from torch_distribute.collectives.communication import CommunicationOptions
from torch_distribute.collectives.failure_diagnosis import FailureDiagnosis, Probe, record_failure
from torch_distribute.collectives.group_collectives import GroupCollectives
from torch_distribute.collectives.group_rendezvous import Rendezvous
from torch_distribute.collectives.liveness import Liveness, MissingWorkers
from torch_distribute.collectives.membership import Membership
from torch_distribute.collectives.store_threads import StoreThreads, register_end_before_teardown
from torch_distribute.errors import ReplicaMismatchError, WorkerUnavailableError

__all__ = ["Agreement", "MissingWorkers", "Probe", "WorkerGroup"]


class WorkerGroup:
    """This process's membership in a job of ``world_size`` workers.

    ``strategy`` (the strategy's class name) is part of what the workers compare at the
    rendezvous (``rendezvous_views.py``); ``peer_addresses`` (each worker's address, where
    known) names the missing ones while waiting. When ``torch.distributed`` is already
    initialized (Ray Train, accelerate, the user's own ``init_process_group``), its group is
    adopted (``adopted``): ``world_size``/``rank`` must be its own, the collectives run on
    groups made from it, and ``close`` destroys only those.

    >>> # group = WorkerGroup("127.0.0.1", 29500, world_size=2, rank=0, options=CommunicationOptions())
    """

    def __init__(
        self,
        host: str,
        port: int,
        world_size: int,
        rank: int,
        options: CommunicationOptions,
        gpus: Sequence[str] = (),
        *,
        strategy: str = "",
        peer_addresses: Sequence[str] = (),
    ):
        register_end_before_teardown()
        self.options = options
        self._closed = False
        self.run_count = 0  # strategy.run calls (begin_run): part of the gradient buckets' signature
        self._member = Membership(host, port, world_size, rank, options.timeout)
        self._threads = StoreThreads()
        self._liveness = Liveness(self._member, self._threads)
        self._diagnosis = FailureDiagnosis(self._member, self._liveness)
        joined = Rendezvous(self._member, options, strategy, peer_addresses, self._threads,
                            self._liveness, self._diagnosis).join(gpus)
        self.store: dist.Store | None = joined.store
        self._groups = joined.groups
        self._agreement = FingerprintAgreement(self._member, self._groups, self._diagnosis,
                                               options.verify_collectives)
        self._collectives = GroupCollectives(self._member, self._groups, self._agreement, self._diagnosis)
        atexit.register(self._at_exit)

    # -- who and where ----------------------------------------------------------------------
    @property
    def host(self) -> str:
        """The address of the chief's store."""
        return self._member.host

    @property
    def port(self) -> int:
        """The port of the chief's store."""
        return self._member.port

    @property
    def world_size(self) -> int:
        return self._member.world_size

    @property
    def rank(self) -> int:
        return self._member.rank

    @property
    def adopted(self) -> bool:
        """Whether the group was made over a process group someone else initialized."""
        return self._groups.adopted

    @property
    def uses_nccl(self) -> bool:
        """Whether CUDA tensors travel on NCCL (else through host memory on Gloo)."""
        return self._groups.uses_nccl

    @property
    def gradient_group(self) -> dist.ProcessGroup | None:
        """The process group of the gradient buckets; None once closed."""
        return self._groups.gradient

    # -- health ---------------------------------------------------------------------------
    def missing_workers(self) -> MissingWorkers | None:
        """Who exited and whose heartbeat stopped; None if the store (the chief) does not
        answer (``Liveness.missing_workers``)."""
        return self._liveness.missing_workers()

    def describe_failure(
        self, what: str, error: BaseException | None, missing: MissingWorkers | None | Probe = Probe.STORE
    ) -> WorkerUnavailableError | ReplicaMismatchError:
        """The error naming who is missing, written for the launcher; ``missing``: a
        ``missing_workers()`` answer the caller already has (``FailureDiagnosis``)."""
        return self._diagnosis.describe_failure(what, error, missing)

    # -- agreement ----------------------------------------------------------------------------
    @property
    def verifies_collectives(self) -> bool:
        """Whether collectives are fingerprinted (``CommunicationOptions.verify_collectives``)."""
        return self._agreement.verifies

    def begin_run(self) -> None:
        """Count one ``strategy.run``: gradient buckets carry it in their signature."""
        self.run_count += 1

    def step_label(self, optimizer_steps: int) -> tuple[int, int]:
        """(step, run) a gradient bucket's signature and fingerprint name: the optimizer's
        own step count and ``run_count``."""
        return optimizer_steps, self.run_count

    @property
    def collectives_failed(self) -> bool:
        """False: a failed collective raises here (a fault-tolerant group's returns instead)."""
        return False

    def agree(self, kind: str, what: str, tensor: torch.Tensor | None = None,
              shape: Sequence[int] | None = None) -> None:
        """Check that every worker is about to make the same collective (when verifying).

        ``kind`` and ``what`` say what it is, ``tensor`` (with ``shape`` instead of its own
        where a dimension may differ) what it carries; a difference raises
        ``ReplicaMismatchError`` on every worker.
        """
        self._agreement.agree(kind, what, tensor, shape)

    def start_agreement(self, kind: str, what: str, tensor: torch.Tensor | None = None,
                        shape: Sequence[int] | None = None) -> Agreement | None:
        """``agree`` in two halves: start the exchange now (it then overlaps whatever runs
        until ``finish_agreement``, which must come before the collective it vouches for).
        None when not verifying."""
        return self._agreement.start(kind, what, tensor, shape)

    def finish_agreement(self, agreement: Agreement) -> None:
        """Wait for an exchange ``start_agreement`` began; raise if the workers differ."""
        self._agreement.finish(agreement)

    def raise_mismatch(self, description: str) -> NoReturn:
        """Every worker found a mismatch in the same collective: exchange what each called and
        raise ``ReplicaMismatchError`` naming them (on every worker)."""
        self._agreement.raise_mismatch(description)

    # -- collectives ------------------------------------------------------------------------
    def wait(self, what: str, work: dist.Work | None) -> None:
        """Wait for an async collective launched elsewhere, with the deadline and naming."""
        self._diagnosis.wait(what, lambda: work)

    def any_true(self, flag: bool, what: str) -> bool:
        """Whether ``flag`` is true on any worker: one collective, the fingerprint included."""
        return self._collectives.any_true(flag, what)

    def gather_small(self, payload: bytes, what: str) -> list[bytes]:
        """Every worker's small ``payload`` (64 bytes at most), in rank order, zero-padded:
        one collective, the fingerprint included."""
        return self._collectives.gather_small(payload, what)

    def all_reduce_(self, tensor: torch.Tensor, op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, what: str = "all_reduce") -> torch.Tensor:
        """In-place SUM (or ``op``) over workers of a tensor on a backend-compatible device."""
        return self._collectives.all_reduce_(tensor, op, what)

    def broadcast_(self, tensor: torch.Tensor, src: int = 0, what: str = "broadcast") -> torch.Tensor:
        """Replace ``tensor`` in place by worker ``src``'s."""
        return self._collectives.broadcast_(tensor, src, what)

    def all_gather_objects(self, value: Any, what: str = "all_gather") -> list[Any]:
        """Small Python values from every worker, in rank order (start-up checks only)."""
        return self._collectives.all_gather_objects(value, what)

    def all_gather_along(self, tensor: torch.Tensor, axis: int, what: str = "gather") -> torch.Tensor:
        """Concatenate ``tensor`` from every worker along ``axis`` (sizes may differ)."""
        return self._collectives.all_gather_along(tensor, axis, what)

    def broadcast_packed_(self, tensors: list[torch.Tensor], src: int = 0, what: str = "broadcast") -> None:
        """Broadcast ``tensors`` from worker ``src`` in place, packed into few buffers."""
        self._collectives.broadcast_packed_(tensors, src, what)

    def average_packed_(self, tensors: list[torch.Tensor], what: str = "average") -> None:
        """Replace ``tensors`` in place by their mean over the workers, packed."""
        self._collectives.average_packed_(tensors, what)

    def all_reduce_async(self, tensor: torch.Tensor) -> dist.Work | None:
        """Start a SUM of ``tensor`` over the workers on the gradient group (never interleaved
        with other collectives); finish it with ``wait(what, handle)``."""
        return self._collectives.all_reduce_async(tensor)

    # -- exit -------------------------------------------------------------------------------
    def _at_exit(self) -> None:
        """At interpreter exit (also after an uncaught exception), tell the others we left,
        and whether the program finished or died of an exception.

        After a clean run, then close: the heartbeat thread joined, the process group
        destroyed and the stores released before the interpreter tears down. Left to
        finalization, about 1 clean run in 20 aborted ("terminate called without an active
        exception"). Closing the group without releasing the stores still aborted 2 launches in
        32 of ``test_gradient_accumulation`` on a loaded 2-core machine. With the stores
        released, 0 aborted in 90 launches. After an uncaught exception or a failed
        collective the group is closed too, but with a deadline: peers may still be inside a
        collective, and tearing it down must not hold this process's exit.
        """
        if self._closed:
            return
        # sys.last_value is set when the program died of an exception.
        failed = self._diagnosis.failed or getattr(sys, "last_value", None) is not None
        if failed:
            record_failure(getattr(sys, "last_value", None))
        self._liveness.stop()
        self._liveness.announce_departure(failed, getattr(sys, "last_value", None))
        self._threads.join(2 * self._member.store_deadline + 1.0)
        if not failed:
            self.close()
            return
        # Torn down now, while the interpreter is whole: gloo and store objects destroyed during
        # its teardown can abort the process (SIGABRT instead of the exception's status 1).
        # Bounded: a peer stuck in a collective must not hold this exit.
        bound = 2 * self._member.store_deadline + 2.0
        store = self.store
        try:
            if store is not None and self._hosts_store_for_others():
                self._threads.within(self._groups.release, bound)
                self._liveness.keep_store_until_others_left(store)
            self._threads.within(self.close, bound)
        except Exception:  # noqa: BLE001 - exiting anyway; the error was reported already
            pass

    def _hosts_store_for_others(self) -> bool:
        """Whether this process serves the store the other workers read (the chief, unless
        torchrun's agent serves it)."""
        return (self.rank == 0 and self.world_size > 1 and self.store is not None
                and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True")

    def close(self) -> None:
        """Leave the group: heartbeat stopped, our process groups destroyed, stores released."""
        if self._closed:
            return
        self._closed = True
        self._liveness.stop()
        atexit.unregister(self._at_exit)
        self._groups.release()
        # Let the stores' C++ objects (the chief's server thread, the heartbeat client) be
        # destroyed now, while the interpreter is whole, not during its teardown.
        self._liveness.forget_client()
        self.store = None
        gc.collect()
