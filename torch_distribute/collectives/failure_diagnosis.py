"""``FailureDiagnosis``: a failed or timed-out collective, turned into an error that names who
is missing and what to do.

A worker that died, stopped or was cut off gives ``WorkerUnavailableError``; workers that
finished their program without calling the collective give ``ReplicaMismatchError`` (the
program ran different collectives on different workers); workers whose program raised give
``PeerProgramError`` with their errors. The first such failure is also written for the
launcher (``failure_record.py``).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable

import torch.distributed as dist

from torch_distribute.collectives import failure_record, fingerprint
from torch_distribute.collectives.liveness import Liveness, MissingWorkers
from torch_distribute.collectives.membership import Membership
from torch_distribute.errors import PeerProgramError, ReplicaMismatchError, WorkerUnavailableError

# How Gloo (and the c10d store) say a peer's socket was closed: the peer process is gone.
_CONNECTION_CLOSED = re.compile(r"Connection (closed|reset) by peer|Broken pipe|ECONNRESET")


class Probe(enum.Enum):
    """``describe_failure(missing=Probe.STORE)``: who is missing is not known yet; ask the
    chief's store (``Liveness.missing_workers``)."""

    STORE = "probe the store"


class FailureDiagnosis:
    """Names the cause of a failed collective, and remembers that one failed here.

    Public surface: ``failed`` (a collective failed, or the workers' collectives differed:
    exit without waiting on the others), ``mark_failed()``, ``describe_failure(what, error,
    missing)`` (the error, recorded for the launcher), ``diagnose`` (the same, unrecorded) and
    ``wait(what, launch)`` (a collective within the deadline, its failure described).

    >>> # diagnosis = FailureDiagnosis(membership, liveness)
    >>> # diagnosis.wait("reduce", lambda: dist.all_reduce(t, async_op=True))
    >>> # WorkerUnavailableError: reduce failed on worker 0 of 2: worker(s) 1 exited ...
    """

    def __init__(self, membership: Membership, liveness: Liveness) -> None:
        self._member = membership
        self._liveness = liveness
        self.failed = False

    def mark_failed(self) -> None:
        """A collective failed here: this worker exits without waiting on the others."""
        self.failed = True

    def wait(self, what: str, launch: Callable[[], dist.Work | None]) -> None:
        """``launch()`` a collective and wait for it within the deadline; a failure is raised
        as ``describe_failure`` words it."""
        try:
            work = launch()
            if work is not None:
                work.wait(self._member.collective_timeout)
        except WorkerUnavailableError:
            raise
        except Exception as error:  # noqa: BLE001 - translated with the missing worker's name
            raise self.describe_failure(what, error) from error

    def describe_failure(
        self, what: str, error: BaseException | None, missing: MissingWorkers | None | Probe = Probe.STORE
    ) -> WorkerUnavailableError | ReplicaMismatchError:
        """``diagnose``, and the result written for the launcher: the first moment this worker
        knows it failed."""
        failure = self.diagnose(what, error, missing)
        record_failure(failure)
        return failure

    def diagnose(
        self, what: str, error: BaseException | None, missing: MissingWorkers | None | Probe = Probe.STORE
    ) -> WorkerUnavailableError | ReplicaMismatchError:
        """The error naming who is missing; ``missing``: a ``missing_workers()`` answer the
        caller already has (probing a dead chief's store takes seconds).

        Workers that finished their program while this one still waits in a collective are
        not a fault but a program whose workers ran different collectives:
        ``ReplicaMismatchError``, which says so, rather than advice to restart.
        """
        self.failed = True
        if isinstance(missing, Probe):
            missing = self._liveness.missing_workers()
        member = self._member
        detail = f" ({type(error).__name__}: {error})" if error is not None else ""
        if missing is not None and missing.finished and set(missing.finished) == set(missing.exited) \
                and not missing.silent:
            return ReplicaMismatchError(
                f"{what} on worker {member.rank} of {member.world_size} (at {fingerprint.call_site()}) "
                f"found no partner: worker(s) {', '.join(map(str, missing.finished))} finished their "
                "program (the end of the script or sys.exit, not an error) without calling it. The "
                "workers ran different collectives (a reduce, a save or an optimizer step on some "
                "workers only, or more steps of data on one worker); restarting will not help. Run "
                "the same collectives on every worker." + detail
            )
        if missing is not None and missing.raised and not missing.silent:
            return self._peer_program_error(what, missing.raised, detail)
        closed = error is not None and _CONNECTION_CLOSED.search(str(error)) is not None
        if missing is None and closed and not self._liveness.store_reachable():
            # Its connections closed and its store refuses new ones: the process is gone (a
            # chief that left normally takes its store, and the record that it left, with it).
            who = (f"worker 0 (the chief, which hosted the rendezvous store at {member.store_address}) "
                   "exited or was killed: its connections closed and its store is gone")
        elif missing is None:
            who = f"worker 0 (the chief, which hosts the rendezvous store at {member.store_address}) is unreachable"
        else:
            # The workers that are the cause first: one that exited after losing a partner
            # (its announcement says "failed") is named after the worker it lost.
            parts = []
            lost_a_partner = [r for r in missing.exited if r not in missing.raised and r not in missing.finished]
            causes = [r for r in missing.exited if r not in lost_a_partner] if missing.silent else missing.exited
            if causes:
                parts.append("worker(s) " + ", ".join(map(str, causes)) + " exited")
            if missing.silent and closed:
                # Its connections were closed under it: the process is gone (a stopped one keeps
                # them open), yet it never said it was leaving.
                parts.append("worker(s) " + ", ".join(map(str, missing.silent)) + " died without "
                             "exiting (killed, e.g. by SIGKILL or the out-of-memory killer, or crashed "
                             "in native code)")
            elif missing.silent:
                parts.append("worker(s) " + ", ".join(map(str, missing.silent)) + " stopped answering")
            if missing.silent and lost_a_partner:
                parts.append("then worker(s) " + ", ".join(map(str, lost_a_partner)) + " exited, having "
                             "lost it as a partner")
            if not parts:
                return WorkerUnavailableError(
                    f"{what} failed on worker {member.rank} of {member.world_size}{detail}, yet every worker "
                    "is alive and answering. Either another worker is busy for longer than "
                    f"{member.timeout:.0f} s (raise CommunicationOptions(timeout_seconds=...)), "
                    "or the workers wait in different collectives, a bug in the program (run them with "
                    "CommunicationOptions(verify_collectives=True), the default, to be told which)."
                )
            who = " and ".join(parts)
        return WorkerUnavailableError(
            f"{what} failed on worker {member.rank} of {member.world_size}: {who}{detail}. "
            f"Collectives wait at most {member.timeout:.0f} s "
            "(CommunicationOptions(timeout_seconds=...)). Restart the job; training resumes from "
            "the last checkpoint (td.BackupAndRestore)."
        )

    def _peer_program_error(self, what: str, raised: dict[int, str], detail: str) -> PeerProgramError:
        listing = "; ".join(f"worker {rank}: {text}" for rank, text in sorted(raised.items()))
        return PeerProgramError(
            f"{what} failed on worker {self._member.rank} of {self._member.world_size}: worker(s) "
            f"{', '.join(map(str, sorted(raised)))} raised an exception in the program and exited "
            f"({listing}). That is an error in the program (its traceback is in that worker's output), "
            "not a lost worker: restarting the job runs into it again. Fix it." + detail,
            raised,
        )


def record_failure(error: BaseException | None) -> None:
    """Write this worker's failure for the launcher (``failure_record.py``): its own, unless
    it is the loss of another worker (``WorkerUnavailableError``) or the program exited on
    its own after one was reported (``error`` None)."""
    failure_record.write(error, consequence=error is None or isinstance(error, WorkerUnavailableError))
