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
"""

from __future__ import annotations

import atexit
import datetime
import gc
import json
import os
import re
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, NoReturn

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose: its functions' default argument
# ``group=group.WORLD`` is evaluated at import time, so importing it later (torch._dynamo
# does, at the first torch.compile or optimizer made) pins the default process group in those
# defaults. destroy_process_group cannot free it then: it is destroyed during the
# interpreter's teardown, its Gloo threads still running, which is when the rare SIGABRT at
# exit ("terminate called without an active exception") happened.
import torch.distributed.nn.functional  # noqa: F401

from torch_distribute.collectives import (
    exchange,
    failure_record,
    fingerprint,
    job_auth,
    job_secret,
    network,
    rendezvous_views,
    store_sockets,
)
from torch_distribute.collectives.communication import (
    CommunicationImplementation,
    CommunicationOptions,
)
from torch_distribute.collectives.packing import apply_packed_
from torch_distribute.collectives.store_connect import connect_store
from torch_distribute.errors import (
    ClusterConfigError,
    InvalidArgumentError,
    JobAuthenticationError,
    PeerProgramError,
    ReplicaMismatchError,
    WorkerUnavailableError,
)
from torch_distribute.log import get_logger

_log = get_logger("collectives")
_HEARTBEAT_PREFIX = "td/heartbeat/"
_LEFT_PREFIX = "td/left/"
_JOINED_PREFIX = "td/joined/"
_GPUS_PREFIX = "td/gpus/"
_FINISHED = "finished"  # the value under _LEFT_PREFIX of a worker whose program ended normally
_RAISED = "raised: "  # ... of one whose program raised (not a lost partner), then its error


class Agreement(NamedTuple):
    """A fingerprint exchange in flight (``WorkerGroup.start_agreement``): the all-gather of
    every worker's row (``exchange.pack``: this worker's fingerprint is ``head``) into the
    rows of ``gathered``."""

    work: Any
    gathered: torch.Tensor
    head: bytes
    what: str
    dtype: torch.dtype | None
    shape: Sequence[int] | None


class MissingWorkers(NamedTuple):
    """Who is gone: ranks that exited (``finished`` those whose program ended without an
    error, ``raised`` those whose program raised, with their error) and ranks whose heartbeat
    stopped."""

    exited: list[int]
    silent: list[int]
    finished: list[int]
    raised: dict[int, str] = {}

    @property
    def anyone(self) -> bool:
        return bool(self.exited or self.silent)


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
        _end_before_teardown_at_exit()
        self.host, self.port = host, port
        self._strategy = strategy
        self._peer_addresses = tuple(peer_addresses)
        self.world_size, self.rank = world_size, rank
        self.options = options
        self._timeout = datetime.timedelta(seconds=options.timeout)
        self._closed = False
        self._verify = options.verify_collectives
        self._failed = False  # a collective failed here: exit without waiting on the others
        # Threads that talk to the store with a deadline; joined (bounded) at exit, because one
        # that returns during interpreter teardown aborts the process (pybind11 + pthread_exit).
        self._store_threads: list[threading.Thread] = []
        self._collectives = 0  # collectives on the default group, fingerprinted or not
        self.run_count = 0  # strategy.run calls (begin_run): part of the gradient buckets' signature
        self._heartbeat_interval = max(0.5, min(5.0, options.timeout / 6))
        # How long the store may take to answer a probe before the chief counts as unreachable
        # (its server is a C++ thread: it answers at once unless the chief is stopped or cut off).
        self._store_deadline = min(5.0, self._heartbeat_interval)
        self._heartbeat_stop = threading.Event()
        self._heartbeat_client: Any = None
        self._heartbeat = threading.Thread(target=self._beat, name="td-heartbeat", daemon=True)
        _backend(options.implementation, bool(gpus), None)  # what needs no other worker, first
        self.adopted = dist.is_initialized()
        if self.adopted:
            self._adopt(gpus)
        else:
            self._start(gpus)
        atexit.register(self._at_exit)

    def _start(self, gpus: Sequence[str]) -> None:
        """Rendezvous at the chief's store, then make the process group and ours."""
        options, rank, world_size, host = self.options, self.rank, self.world_size, self.host
        # One worker alone: nobody to authenticate (and nothing to warn about).
        self._secret = (job_secret.required_secret(host, f"The job's rendezvous (worker {rank} of {world_size})")
                        if world_size > 1 else job_secret.job_secret())
        _remember_store(host, self.port)
        self.store = self._rendezvous()
        # Heartbeats from here on: a worker that dies during the rest of the start-up is named.
        self._heartbeat.start()
        try:
            shared = self._start_up_step("start-up: the GPU check", lambda: self._gpus_shared_with_others(gpus))
            backend = _backend(options.implementation, bool(gpus), shared)
            self.uses_nccl = "nccl" in backend
            _choose_gloo_interface(backend, host)
            self._start_up_step("start-up: init_process_group", lambda: dist.init_process_group(
                backend, store=self.store, rank=rank, world_size=world_size, timeout=self._timeout))
            self._main_group = dist.group.WORLD
            _log.info("worker %d of %d: process group on backend %s, rendezvous at %s:%d, timeout %ss",
                      rank, world_size, backend, host, self.port, options.timeout)
            # Gradients travel on their own group so they never interleave with other collectives.
            self.gradient_group = self._start_up_step(
                "start-up: the gradient group", lambda: dist.new_group(backend=backend, timeout=self._timeout))
        except BaseException:
            self._heartbeat_stop.set()
            raise

    def _adopt(self, gpus: Sequence[str]) -> None:
        """Join a process group made by someone else: our collective group and a store of our
        own (for heartbeats and the rendezvous checks) made from it, then the gradient group."""
        _check_adoptable(self.world_size, self.rank)
        backend = _backend(self.options.implementation, bool(gpus), None)
        self.uses_nccl = "nccl" in backend
        self._main_group = self._adoption_step(
            "the strategy's process group", lambda: dist.new_group(backend=backend, timeout=self._timeout))
        chief = self.rank == 0
        if chief:
            self.port = 0  # a free port: the existing group's store may hold the cluster's port
            self.store = self._connect_store(hosts_store=True)
        self.host, self.port, self._secret = self._adoption_step(
            "the address of the chief's store", self._share_store_address)
        _remember_store(self.host, self.port)
        if not chief:
            self.store = self._connect_store(hosts_store=False)
        self._meet(self.store, hosts_store=chief)
        self._authenticate(self.store)
        self._heartbeat.start()
        try:
            self.gradient_group = self._start_up_step(
                "start-up: the gradient group", lambda: dist.new_group(backend=backend, timeout=self._timeout))
        except BaseException:
            self._heartbeat_stop.set()
            raise

    def _adoption_step(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()`` (a collective over the adopted group) within the deadline; the error
        says that some process of the group did not create the strategy."""
        seconds = self.options.timeout + self._store_deadline
        try:
            return self._within(call, seconds)
        except Exception as error:  # noqa: BLE001 - translated with what to check
            reason = f"no answer within {seconds:.0f} s" if isinstance(error, TimeoutError) else \
                f"{type(error).__name__}: {error}"
            raise WorkerUnavailableError(
                f"Worker {self.rank} of the existing process group ({self.world_size} processes) could "
                f"not make {what} together with the others ({reason}): every process of the group must "
                "create the strategy, in the same order. Collectives wait at most "
                f"{self.options.timeout:.0f} s (CommunicationOptions(timeout_seconds=...))."
            ) from error

    def _share_store_address(self) -> tuple[str, int, bytes]:
        """The chief's ``(host, port)`` of its store and the secret its workers prove there (the
        job's, else a fresh one), broadcast over our group: the adopted group's processes are
        the job, so no secret need be configured for them."""
        payload = torch.zeros(4096, dtype=torch.uint8)
        if self.rank == 0:
            secret = job_secret.job_secret() or job_secret.new_secret().encode()
            text = json.dumps([self.host, self.port, secret.hex()]).encode()
            payload[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self._main_group)
        host, port, secret_hex = json.loads(bytes(payload.tolist()).rstrip(b"\0"))
        return str(host), int(port), bytes.fromhex(secret_hex)

    def _start_up_step(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()``, given ``timeout_seconds`` plus a heartbeat interval: a chief that stops
        during the start-up leaves torch's store clients blocked in ``recv`` with no deadline.
        Its errors, and running out of time, are reported naming the missing worker."""
        try:
            return self._within(call, self.options.timeout + self._store_deadline)
        except TimeoutError as error:
            raise self.describe_failure(what, None) from error
        except WorkerUnavailableError:
            raise
        except Exception as error:  # noqa: BLE001 - translated with the missing worker's name
            raise self.describe_failure(what, error) from error

    def _within(self, call: Callable[[], Any], seconds: float) -> Any:
        """``call()`` in a store thread; its result or its exception, or ``TimeoutError``."""
        outcome: list[Any] = []

        def run() -> None:
            try:
                outcome.append((True, call()))
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                outcome.append((False, error))

        self._in_store_thread(run).join(seconds)
        if not outcome:
            raise TimeoutError(f"no answer within {seconds:.1f} s")
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def _rendezvous(self) -> dist.TCPStore:
        """Meet at the chief's TCPStore; name the workers that did not turn up in time."""
        # Under torchrun the elastic agent already serves the store at MASTER_PORT.
        hosts_store = self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        store = self._connect_store(hosts_store)
        self._meet(store, hosts_store)
        self._authenticate(store)
        return store

    def _authenticate(self, store: dist.TCPStore) -> None:
        """Every worker proves the job secret before its rank is accepted (job_auth.py)."""
        timeout = self.options.timeout
        try:
            self._within(lambda: job_auth.authenticate(store, self.rank, self.world_size, self._secret,
                                                       f"{self.host}:{self.port}", timeout),
                         timeout + self._store_deadline)
        except JobAuthenticationError:
            raise
        except Exception as error:  # noqa: BLE001 - rewrapped with what to check
            raise WorkerUnavailableError(
                f"Worker {self.rank} could not finish proving the job secret at {self.host}:{self.port} "
                f"within {timeout:.0f} s ({error}): a worker or the chief stopped during the rendezvous. "
                "Restart the job."
            ) from error

    def _connect_store(self, hosts_store: bool) -> dist.TCPStore:
        """Host the store (the chief), or connect to it, retried within the whole timeout."""
        timeout = self.options.timeout
        try:
            if hosts_store:
                # Bound to the address the job meets at (loopback for a local job), not every interface.
                listener = job_auth.listening_socket(self.host, self.port)
                raw = dist.TCPStore(self.host, self.port, self.world_size, is_master=True,
                                    timeout=self._timeout, wait_for_workers=False,
                                    master_listen_fd=listener.detach() if listener is not None else None)
                self.port = raw.port  # port 0 (a single local worker) picks a free one
                store = job_auth.namespaced(raw)
            else:
                # A stopped chief accepts the connection and never answers: bounded here too.
                store = job_auth.namespaced(self._within(
                    lambda: connect_store(self.host, self.port, self.world_size, timeout),
                    timeout + self._store_deadline))
                store.set_timeout(self._timeout)
        except Exception as error:  # noqa: BLE001 - rewrapped with what to check
            raise WorkerUnavailableError(
                f"Worker {self.rank} could not reach the chief (worker 0) at {self.host}:{self.port} "
                f"within {timeout:.0f} s ({error}). Check that the chief is running and that every "
                "worker was started with the same cluster configuration."
            ) from error
        return store

    def _peer_name(self, rank: int) -> str:
        address = self._peer_addresses[rank] if rank < len(self._peer_addresses) else ""
        return f"worker {rank} at {address}" if ":" in address else f"worker {rank}"

    def _meet(self, store: dist.TCPStore, hosts_store: bool) -> None:
        """Every worker publishes its view of the job and waits for all the others
        (``rendezvous_views.py``): a disagreement raises ``ClusterConfigError`` at once."""
        timeout = self.options.timeout
        view = rendezvous_views.own_view(self.world_size, self.rank, f"{self.host}:{self.port}", self._strategy)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's store outlives an attempt
        views = rendezvous_views.ViewExchange(store, view, hosts_store, self._peer_name, namespace=attempt)
        deadline = time.monotonic() + timeout

        def meet() -> set[int]:
            store.set(f"{_JOINED_PREFIX}{self.rank}", "1")
            views.publish()
            return views.wait_all(deadline)

        try:
            joined = self._within(meet, timeout + self._store_deadline)
        except ClusterConfigError:
            raise
        except TimeoutError as error:
            raise WorkerUnavailableError(
                f"Worker {self.rank} reached the chief's store at {self.host}:{self.port}, but it "
                f"stopped answering (no reply within {timeout + self._store_deadline:.0f} s): worker 0 "
                "(the chief) is stopped or cut off. Restart the job."
            ) from error
        except Exception as error:  # noqa: BLE001 - rewrapped with what to check
            raise WorkerUnavailableError(
                f"Worker {self.rank} lost the chief's store at {self.host}:{self.port} while waiting "
                f"for the other workers ({type(error).__name__}: {error}): worker 0 (the chief) exited "
                "or is unreachable."
            ) from error
        missing = [rank for rank in range(self.world_size) if rank not in joined]
        if missing:
            raise WorkerUnavailableError(
                f"Worker {self.rank} waited {timeout:.0f} s at {self.host}:{self.port} for all "
                f"{self.world_size} workers, but {', '.join(self._peer_name(r) for r in missing)} never "
                "joined. Start every worker (same cluster configuration), or raise "
                "CommunicationOptions(timeout_seconds=...)."
            )

    def _gpus_shared_with_others(self, gpus: Sequence[str]) -> str | None:
        """Which other worker drives one of ``gpus`` (the physical GPUs of this worker), if any."""
        self.store.set(f"{_GPUS_PREFIX}{self.rank}", json.dumps(sorted(gpus)))
        keys = [f"{_GPUS_PREFIX}{r}" for r in range(self.world_size)]
        self.store.wait(keys, self._timeout)
        mine = set(gpus)
        for rank, key in enumerate(keys):
            common = mine.intersection(json.loads(self.store.get(key))) if rank != self.rank else ()
            if common:
                return f"workers {min(rank, self.rank)} and {max(rank, self.rank)} share GPU {sorted(common)[0]}"
        return None

    # -- health ---------------------------------------------------------------------------
    def _beat(self) -> None:
        try:
            # Retried like the main connection (a lost connection attempt must not silence it),
            # within the time _stop_heartbeat waits for this thread.
            client = job_auth.namespaced(connect_store(
                self.host, self.port, self.world_size, self._heartbeat_interval * 2 + 1))
        except Exception:  # noqa: BLE001 - no heartbeat is reported as "not answering"
            return
        self._heartbeat_client = client
        while not self._heartbeat_stop.is_set():
            try:
                client.set(f"{_HEARTBEAT_PREFIX}{self.rank}", repr(time.time()))
            except Exception:  # noqa: BLE001 - the store (the chief) is gone
                return
            self._heartbeat_stop.wait(self._heartbeat_interval)

    def _stop_heartbeat(self) -> None:
        self._heartbeat_stop.set()
        if self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=2 * self._heartbeat_interval + 2.0)

    def _in_store_thread(self, call: Callable[[], Any]) -> threading.Thread:
        """Run ``call`` (store traffic) in a daemon thread of its own, remembered for exit."""
        self._store_threads = [t for t in self._store_threads if t.is_alive()]
        thread = threading.Thread(target=call, name="td-store", daemon=True)
        thread.start()
        self._store_threads.append(thread)
        _STORE_THREADS[:] = [t for t in _STORE_THREADS if t.is_alive()] + [thread]
        return thread

    def _join_store_threads(self) -> None:
        deadline = time.monotonic() + 2 * self._store_deadline + 1.0
        for thread in self._store_threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _store_reachable(self) -> bool:
        """Whether the chief's store accepts a connection at all (a dead chief refuses it)."""
        try:
            socket.create_connection((self.host, self.port), timeout=self._store_deadline).close()
            return True
        except OSError:
            return False

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
        failed = self._failed or getattr(sys, "last_value", None) is not None
        if failed:
            _record_failure(getattr(sys, "last_value", None))
        self._stop_heartbeat()
        client = self._heartbeat_client
        if client is not None:
            # A stopped chief never answers: the announcement must not hold this exit.
            how = _how_it_left(getattr(sys, "last_value", None)) if failed else _FINISHED
            self._in_store_thread(lambda: _ignore_errors(client.set, f"{_LEFT_PREFIX}{self.rank}", how))
        self._join_store_threads()
        if not failed:
            self.close()
            return
        # Torn down now, while the interpreter is whole: gloo and store objects destroyed during
        # its teardown can abort the process (SIGABRT instead of the exception's status 1).
        # Bounded: a peer stuck in a collective must not hold this exit.
        try:
            if self._hosts_store_for_others():
                self._within(self._release_groups, 2 * self._store_deadline + 2.0)
                self._keep_store_until_others_left()
            self._within(self.close, 2 * self._store_deadline + 2.0)
        except Exception:  # noqa: BLE001 - exiting anyway; the error was reported already
            pass

    def _hosts_store_for_others(self) -> bool:
        """Whether this process serves the store the other workers read (the chief, unless
        torchrun's agent serves it)."""
        return (self.rank == 0 and self.world_size > 1 and self.store is not None
                and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True")

    def _keep_store_until_others_left(self) -> None:
        """The chief failed, and its store (who left, and why) would end with it: the others
        would then only learn that the chief is gone, and name it instead of the worker that
        failed first. Keep serving until every other worker has left or stopped beating (a
        few heartbeat intervals at most); its process groups are closed already, so the others'
        collectives fail at once."""
        store = self.store
        deadline = time.monotonic() + 3 * self._heartbeat_interval + 2 * self._store_deadline
        while time.monotonic() < deadline:
            try:
                now = time.time()
                waiting = [
                    rank for rank in range(1, self.world_size)
                    if not store.check([f"{_LEFT_PREFIX}{rank}"]) and store.check([f"{_HEARTBEAT_PREFIX}{rank}"])
                    and now - float(store.get(f"{_HEARTBEAT_PREFIX}{rank}")) <= 2 * self._heartbeat_interval
                ]
            except Exception:  # noqa: BLE001 - the store is gone: nothing to keep
                return
            if not waiting:
                return
            time.sleep(0.1)

    def missing_workers(self) -> MissingWorkers | None:
        """Who exited and whose heartbeat stopped; None if the store (the chief) does not answer.

        A worker killed a moment ago still has a fresh heartbeat, so this waits up to three
        heartbeat intervals for one to go stale before concluding that nobody is missing. The
        store must answer within ``_store_deadline`` seconds: a stopped (SIGSTOP) or cut-off
        chief accepts the connection and never replies, and a dead one refuses it.
        """
        if not self._store_reachable():
            return None
        answered = threading.Event()
        answer: list[MissingWorkers] = []

        def probe_store() -> None:
            try:
                probe = job_auth.namespaced(dist.TCPStore(
                    self.host, self.port, self.world_size, is_master=False,
                    timeout=datetime.timedelta(seconds=self._store_deadline)))
                deadline = time.time() + 3 * self._heartbeat_interval
                while True:
                    left = {r: probe.get(f"{_LEFT_PREFIX}{r}").decode()
                            for r in range(self.world_size) if probe.check([f"{_LEFT_PREFIX}{r}"])}
                    answered.set()
                    now = time.time()
                    silent = []
                    for rank in range(self.world_size):
                        key = f"{_HEARTBEAT_PREFIX}{rank}"
                        if rank not in left and (
                            not probe.check([key]) or now - float(probe.get(key)) > 2 * self._heartbeat_interval
                        ):
                            silent.append(rank)
                    if left or silent or time.time() > deadline:
                        finished = [r for r, how in left.items() if how == _FINISHED]
                        raised = {r: how[len(_RAISED):] for r, how in left.items() if how.startswith(_RAISED)}
                        answer.append(MissingWorkers(sorted(left), silent, finished, raised))
                        return
                    time.sleep(self._heartbeat_interval / 2)
            except Exception:  # noqa: BLE001 - no answer: the chief is unreachable
                return

        thread = self._in_store_thread(probe_store)
        if not answered.wait(self._store_deadline):
            return None
        thread.join(3 * self._heartbeat_interval + self._store_deadline)
        return answer[0] if answer else None

    def describe_failure(
        self, what: str, error: BaseException | None, missing: Any = "probe"
    ) -> WorkerUnavailableError | ReplicaMismatchError:
        failure = self._diagnose(what, error, missing)
        _record_failure(failure)  # ... the first moment this worker knows it failed
        return failure

    def _diagnose(
        self, what: str, error: BaseException | None, missing: Any = "probe"
    ) -> WorkerUnavailableError | ReplicaMismatchError:
        """The error naming who is missing; ``missing``: a ``missing_workers()`` answer the
        caller already has (probing a dead chief's store takes seconds).

        Workers that finished their program while this one still waits in a collective are
        not a fault but a program whose workers ran different collectives:
        ``ReplicaMismatchError``, which says so, rather than advice to restart.
        """
        self._failed = True
        if missing == "probe":
            missing = self.missing_workers()
        detail = f" ({type(error).__name__}: {error})" if error is not None else ""
        if missing is not None and missing.finished and set(missing.finished) == set(missing.exited) \
                and not missing.silent:
            return ReplicaMismatchError(
                f"{what} on worker {self.rank} of {self.world_size} (at {fingerprint.call_site()}) "
                f"found no partner: worker(s) {', '.join(map(str, missing.finished))} finished their "
                "program (the end of the script or sys.exit, not an error) without calling it. The "
                "workers ran different collectives (a reduce, a save or an optimizer step on some "
                "workers only, or more steps of data on one worker); restarting will not help. Run "
                "the same collectives on every worker." + detail
            )
        if missing is not None and missing.raised and not missing.silent:
            return self._peer_program_error(what, missing.raised, detail)
        closed = error is not None and _CONNECTION_CLOSED.search(str(error)) is not None
        if missing is None and closed and not self._store_reachable():
            # Its connections closed and its store refuses new ones: the process is gone (a
            # chief that left normally takes its store, and the record that it left, with it).
            who = (f"worker 0 (the chief, which hosted the rendezvous store at {self.host}:{self.port}) "
                   "exited or was killed: its connections closed and its store is gone")
        elif missing is None:
            who = f"worker 0 (the chief, which hosts the rendezvous store at {self.host}:{self.port}) is unreachable"
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
                    f"{what} failed on worker {self.rank} of {self.world_size}{detail}, yet every worker "
                    "is alive and answering. Either another worker is busy for longer than "
                    f"{self.options.timeout:.0f} s (raise CommunicationOptions(timeout_seconds=...)), "
                    "or the workers wait in different collectives, a bug in the program (run them with "
                    "CommunicationOptions(verify_collectives=True), the default, to be told which)."
                )
            who = " and ".join(parts)
        return WorkerUnavailableError(
            f"{what} failed on worker {self.rank} of {self.world_size}: {who}{detail}. "
            f"Collectives wait at most {self.options.timeout:.0f} s "
            "(CommunicationOptions(timeout_seconds=...)). Restart the job; training resumes from "
            "the last checkpoint (td.BackupAndRestore)."
        )

    def _peer_program_error(self, what: str, raised: dict[int, str], detail: str) -> PeerProgramError:
        listing = "; ".join(f"worker {rank}: {text}" for rank, text in sorted(raised.items()))
        return PeerProgramError(
            f"{what} failed on worker {self.rank} of {self.world_size}: worker(s) "
            f"{', '.join(map(str, sorted(raised)))} raised an exception in the program and exited "
            f"({listing}). That is an error in the program (its traceback is in that worker's output), "
            "not a lost worker: restarting the job runs into it again. Fix it." + detail,
            raised,
        )

    # -- agreement ----------------------------------------------------------------------------
    @property
    def verifies_collectives(self) -> bool:
        """Whether collectives are fingerprinted (``CommunicationOptions.verify_collectives``)."""
        return self._verify

    def begin_run(self) -> None:
        """Count one ``strategy.run``: gradient buckets carry it in their signature."""
        self.run_count += 1

    def any_true(self, flag: bool, what: str) -> bool:
        """Whether ``flag`` is true on any worker: one collective, the fingerprint included."""
        if not self._verify:
            self._collectives += 1
            mine = torch.tensor([int(flag)])
            self._wait(what, lambda: dist.all_reduce(mine, group=self._main_group, async_op=True))
            return bool(mine[0] > 0)
        agreement = self._start_exchange("any_true", what, None, None, b"\x01" if flag else b"\x00")
        return any(payload[0] for payload in self._finish_exchange(agreement))

    def _start_exchange(self, kind: str, what: str, dtype: torch.dtype | None, shape: Sequence[int] | None,
                        payload: bytes = b"", compared: Sequence[int] | None = None) -> Agreement:
        """Start one all-gather of this collective's fingerprint (of ``compared``, or of
        ``shape``) followed by ``payload`` (``exchange.py``). An all-gather: Gloo's all-reduce
        of more than one element costs about twice as much. Called on the process group
        itself: ``dist.all_gather``'s checks and logging cost more than the rest of the
        exchange, and the row is well-formed by construction."""
        self._collectives += 1
        head = fingerprint.encode(kind, what, dtype, compared if compared is not None else shape)
        gathered = torch.empty(self.world_size, exchange.WIDTH, dtype=torch.int64)
        try:
            work = self._main_group.allgather([list(gathered.unbind(0))], [exchange.pack(head, payload)])
        except Exception as error:  # noqa: BLE001 - translated with the missing worker's name
            raise self.describe_failure(what, error) from error
        return Agreement(work, gathered, head, what, dtype, shape)

    def _finish_exchange(self, agreement: Agreement) -> list[bytes]:
        """Wait for an exchange; every worker's payload, or ``ReplicaMismatchError`` on every
        worker."""
        self.wait(agreement.what, agreement.work)
        rows = exchange.rows(agreement.gathered)
        if any(head != agreement.head for head, _ in rows):
            self.raise_mismatch(fingerprint.describe(agreement.what, agreement.dtype, agreement.shape))
        return [payload for _, payload in rows]

    def agree(self, kind: str, what: str, tensor: torch.Tensor | None = None,
              shape: Sequence[int] | None = None) -> None:
        """Check that every worker is about to make the same collective (when verifying).

        ``kind`` and ``what`` say what it is, ``tensor`` (with ``shape`` instead of its own
        where a dimension may differ) what it carries; a difference raises
        ``ReplicaMismatchError`` on every worker.
        """
        agreement = self.start_agreement(kind, what, tensor, shape)
        if agreement is not None:
            self.finish_agreement(agreement)

    def start_agreement(self, kind: str, what: str, tensor: torch.Tensor | None = None,
                        shape: Sequence[int] | None = None) -> Agreement | None:
        """``agree`` in two halves: start the exchange now (it then overlaps whatever runs
        until ``finish_agreement``, which must come before the collective it vouches for).
        None when not verifying."""
        _log.debug("collective #%d: %s (%s)", self._collectives + 1, what, kind)
        if not self._verify:
            self._collectives += 1
            return None
        dtype = tensor.dtype if tensor is not None else None
        own_shape = tuple(tensor.shape) if tensor is not None else None
        return self._start_exchange(kind, what, dtype, own_shape,
                                    compared=tuple(shape) if shape is not None else None)

    def finish_agreement(self, agreement: Agreement) -> None:
        """Wait for an exchange ``start_agreement`` began; raise if the workers differ."""
        self._finish_exchange(agreement)

    def raise_mismatch(self, description: str) -> NoReturn:
        """Every worker found a mismatch in the same collective: exchange what each called and
        raise ``ReplicaMismatchError`` naming them (on every worker)."""
        self._failed = True
        mine = f"{description} at {fingerprint.call_site()}"
        calls: list[Any] = [None] * self.world_size
        self._wait("the exchange of mismatched collectives", lambda: dist.all_gather_object(calls, mine, group=self._main_group))
        listing = "; ".join(f"worker {rank}: {call}" for rank, call in enumerate(calls))
        raise ReplicaMismatchError(
            f"The workers called different collectives at the same point (collective "
            f"#{self._collectives} of worker {self.rank}): {listing}. Every worker must make the same "
            "reductions, gathers, saves and optimizer steps, in the same order and with tensors of "
            "the same dtype and shape (look for one inside an `if` on the worker index, or for "
            "workers with different amounts of data)."
        )

    # -- collectives ------------------------------------------------------------------------
    def _wait(self, what: str, launch: Callable[[], Any]) -> None:
        try:
            work = launch()
            if work is not None:
                work.wait(self._timeout)
        except WorkerUnavailableError:
            raise
        except Exception as error:  # noqa: BLE001 - translated with the missing worker's name
            raise self.describe_failure(what, error) from error

    def wait(self, what: str, work: Any) -> None:
        """Wait for an async collective launched elsewhere, with the deadline and naming."""
        self._wait(what, lambda: work)

    def all_reduce_(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, what: str = "all_reduce") -> torch.Tensor:
        """In-place SUM (or ``op``) over workers of a tensor on a backend-compatible device.

        A small tensor (a loss, a metric's totals) travels inside its fingerprint's exchange
        and is combined here, in rank order: one collective instead of two.
        """
        if self._verify and exchange.can_carry(tensor, op):
            agreement = self._start_exchange(f"all_reduce {op}", what, tensor.dtype, tuple(tensor.shape),
                                             exchange.small_values(tensor))
            return tensor.copy_(exchange.combine(self._finish_exchange(agreement), op, tensor))
        self.agree(f"all_reduce {op}", what, tensor)
        target = self._comm_tensor(tensor)
        self._wait(what, lambda: dist.all_reduce(target, op=op, group=self._main_group, async_op=True))
        if target is not tensor:
            tensor.copy_(target)
        return tensor

    def broadcast_(self, tensor: torch.Tensor, src: int = 0, what: str = "broadcast") -> torch.Tensor:
        self.agree(f"broadcast from {src}", what, tensor)
        target = self._comm_tensor(tensor)
        self._wait(what, lambda: dist.broadcast(target, src=src, group=self._main_group, async_op=True))
        if target is not tensor:
            tensor.copy_(target)
        return tensor

    def all_gather_objects(self, value: Any, what: str = "all_gather") -> list[Any]:
        """Small Python values from every worker, in rank order (start-up checks only)."""
        self.agree("all_gather_objects", what)
        out: list[Any] = [None] * self.world_size
        self._wait(what, lambda: dist.all_gather_object(out, value, group=self._main_group))
        return out

    def all_gather_along(self, tensor: torch.Tensor, axis: int, what: str = "gather") -> torch.Tensor:
        """Concatenate ``tensor`` from every worker along ``axis`` (sizes may differ)."""
        off_axis = tuple(-1 if d == axis else n for d, n in enumerate(tensor.shape))
        sizes = torch.tensor([tensor.shape[axis]], dtype=torch.int64)
        if self._verify:  # the sizes travel with the fingerprint
            agreement = self._start_exchange(f"all_gather along {axis}", what, tensor.dtype, tuple(tensor.shape),
                                             struct.pack("<q", tensor.shape[axis]), compared=off_axis)
            counts = [struct.unpack_from("<q", payload)[0] for payload in self._finish_exchange(agreement)]
        else:
            self._collectives += 1
            all_sizes = [torch.zeros_like(sizes) for _ in range(self.world_size)]
            self._wait(what, lambda: dist.all_gather(all_sizes, sizes, group=self._main_group, async_op=True))
            counts = [int(s[0]) for s in all_sizes]
        longest = max(counts)
        padded = tensor
        if tensor.shape[axis] < longest:
            pad_shape = list(tensor.shape)
            pad_shape[axis] = longest - tensor.shape[axis]
            padded = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=axis)
        padded = self._comm_tensor(padded.contiguous())
        pieces = [torch.empty_like(padded) for _ in range(self.world_size)]
        self._wait(what, lambda: dist.all_gather(pieces, padded, group=self._main_group, async_op=True))
        return torch.cat([p.narrow(axis, 0, n).to(tensor.device) for p, n in zip(pieces, counts, strict=True)], dim=axis)

    def broadcast_packed_(self, tensors: list[torch.Tensor], src: int = 0, what: str = "broadcast") -> None:
        """Broadcast ``tensors`` from worker ``src`` in place, packed into few buffers."""
        apply_packed_(tensors, lambda flat: self.broadcast_(flat, src=src, what=what))

    def average_packed_(self, tensors: list[torch.Tensor], what: str = "average") -> None:
        """Replace ``tensors`` in place by their mean over the workers, packed."""
        apply_packed_(tensors, lambda flat: self.all_reduce_(flat, what=what).div_(self.world_size))

    def all_reduce_async(self, tensor: torch.Tensor) -> Any:
        """Start a SUM of ``tensor`` over the workers on the gradient group (never interleaved
        with other collectives); finish it with ``wait(what, handle)``."""
        _log.debug("gradient bucket all-reduce (%d values) on the gradient group", tensor.numel())
        return dist.all_reduce(tensor, group=self.gradient_group, async_op=True)

    def _comm_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_cuda and not self.uses_nccl:
            return tensor.cpu()
        return tensor

    def _release_groups(self) -> None:
        # No reference of ours may keep a process group alive past destroy_process_group: its
        # connections must close now (peers learn at once that this worker left) and its C++
        # threads must not outlive the interpreter's teardown.
        own_groups = (self._main_group, self.gradient_group)
        self._main_group = self.gradient_group = None
        if self.adopted:
            _destroy_groups(own_groups)  # the adopted group is its maker's to destroy
        elif dist.is_initialized():
            dist.destroy_process_group()
        del own_groups

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_heartbeat()
        atexit.unregister(self._at_exit)
        self._release_groups()
        # Let the stores' C++ objects (the chief's server thread, the heartbeat client) be
        # destroyed now, while the interpreter is whole, not during its teardown.
        self._heartbeat_client = None
        self.store = None
        gc.collect()


# Every thread that calls into torch's store (C++) with a deadline of its own. One still
# blocked there when the interpreter finalizes aborts the process the moment its call returns
# (pybind11 meets pthread_exit: "terminate called without an active exception", SIGABRT),
# whatever the program's status was. _end_before_teardown, registered when the first group
# starts (before its first store thread and its own _at_exit) and so run after every atexit
# handler registered later (every WorkerGroup._at_exit among them), wakes those calls
# (store_sockets.py) or, failing that, ends the process itself. Not at import: importing the
# package leaves the interpreter's exit as it was (strategies/torch_patches.py).
_STORE_THREADS: list[threading.Thread] = []
# (the store's addresses, its port) of every group made in this process: whom the calls wait on.
_STORES: list[tuple[list[str], int]] = []


def _remember_store(host: str, port: int) -> None:
    _STORES.append((store_sockets.addresses_of(host), port))


def _wake_blocked_store_calls(seconds: float) -> bool:
    """Shut down this process's connections to the stores until every store thread has ended
    (a client retrying reconnects, and is shut down again); whether they all did."""
    deadline = time.monotonic() + seconds
    while True:
        alive = [thread for thread in _STORE_THREADS if thread.is_alive()]
        if not alive:
            return True
        if time.monotonic() >= deadline:
            return False
        for addresses, port in _STORES:
            store_sockets.shut_down_connections_to(addresses, port)
        for thread in alive:
            thread.join(0.05)


def _end_before_teardown() -> None:
    """If a store call is still blocked (the chief is stopped or cut off), wake it: the process
    then exits with the status its program asked for (``sys.exit(n)``, 1 after an uncaught
    exception). Where that fails (no ``/proc``), end the process now, stdout and stderr
    flushed, with 1 after an uncaught exception and otherwise 0 (a ``sys.exit(n)`` status
    cannot be seen from here)."""
    deadline = time.monotonic() + 1.0
    for thread in _STORE_THREADS:
        thread.join(max(0.0, deadline - time.monotonic()))
    if not any(thread.is_alive() for thread in _STORE_THREADS):
        return
    _note("a call to worker 0's store is still blocked (worker 0 is stopped or unreachable); "
          "closing this process's connections to it before exiting (torch may log "
          "'recvValue failed' for them)")
    if _wake_blocked_store_calls(5.0):
        return
    status = 1 if getattr(sys, "last_value", None) is not None else 0
    try:
        _note(f"the call is still blocked; ending this process now with status {status}, before "
              "the interpreter's teardown, which would abort when that call returns")
        sys.stdout.flush()
    finally:
        os._exit(status)


def _note(message: str) -> None:
    try:
        sys.stderr.write(f"torch-distribute: {message}.\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _end_before_teardown_at_exit() -> None:
    """Register ``_end_before_teardown`` with ``atexit``, once: when the first group starts."""
    if not _END_REGISTERED:
        atexit.register(_end_before_teardown)
        _END_REGISTERED.append(True)


_END_REGISTERED: list[bool] = []

# How Gloo (and the c10d store) say a peer's socket was closed: the peer process is gone.
_CONNECTION_CLOSED = re.compile(r"Connection (closed|reset) by peer|Broken pipe|ECONNRESET")


def _how_it_left(error: BaseException | None) -> str:
    """What a failed worker announces under ``_LEFT_PREFIX``: its program's own error, where
    it was raised (``_RAISED``), or ``failed`` (it lost a partner, or a collective failed)."""
    if error is None or isinstance(error, (WorkerUnavailableError, ReplicaMismatchError)):
        return "failed"
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    text = f"{type(error).__name__}: {error}"
    return _RAISED + (text if len(text) <= 400 else text[:397] + "...") + where


def _record_failure(error: BaseException | None) -> None:
    """Write this worker's failure for the launcher (``failure_record.py``): its own, unless
    it is the loss of another worker (``WorkerUnavailableError``) or the program exited on
    its own after one was reported (``error`` None)."""
    failure_record.write(error, consequence=error is None or isinstance(error, WorkerUnavailableError))


def _ignore_errors(call: Callable[..., Any], *args: Any) -> None:
    try:
        call(*args)
    except Exception:  # noqa: BLE001 - best effort: the store may be gone
        pass


def _check_adoptable(world_size: int, rank: int) -> None:
    """The initialized default group must be the job this worker was told about."""
    actual_world, actual_rank = dist.get_world_size(), dist.get_rank()
    if (actual_world, actual_rank) != (world_size, rank):
        raise ClusterConfigError(
            f"torch.distributed is already initialized with {actual_world} processes (this one is "
            f"rank {actual_rank}), but the cluster resolver makes this worker {rank} of {world_size}: "
            "pass no cluster_resolver to use the existing process group, or one that describes it"
        )


def _destroy_groups(groups: Sequence[Any]) -> None:
    """Destroy the groups this module made over an adopted group (never the default group)."""
    for group in groups:
        if group is not None and group is not dist.group.WORLD and dist.is_initialized():
            _ignore_errors(dist.destroy_process_group, group)


def _choose_gloo_interface(backend: str, chief_host: str) -> None:
    """Point Gloo at the interface that reaches the chief when the job spans machines.

    Left alone when ``GLOO_SOCKET_IFNAME`` is set, when the chief is on this machine (a
    loopback address) and when no interface can be found.
    """
    if "gloo" not in backend or os.environ.get("GLOO_SOCKET_IFNAME") or network.is_loopback(chief_host):
        return
    interface = network.interface_towards(chief_host)
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface


def _backend(implementation: CommunicationImplementation, use_cuda: bool, shared_gpu: str | None) -> str:
    """NCCL for CUDA tensors where it can run; Gloo (through host memory) otherwise.

    NCCL refuses two ranks on one GPU, so workers sharing one get Gloo under AUTO."""
    nccl = use_cuda and torch.cuda.is_available() and dist.is_nccl_available()
    if implementation is CommunicationImplementation.NCCL:
        if not nccl:
            raise InvalidArgumentError(
                "CommunicationImplementation.NCCL needs CUDA devices and a PyTorch build with NCCL; "
                "use CommunicationImplementation.AUTO or RING on CPUs."
            )
        if shared_gpu is not None:
            raise InvalidArgumentError(
                f"CommunicationImplementation.NCCL cannot run here: {shared_gpu}, and NCCL refuses "
                "two ranks on one GPU. Give each worker its own GPU (CUDA_VISIBLE_DEVICES), or use "
                "CommunicationImplementation.AUTO or RING (Gloo, through host memory)."
            )
        # Gloo beside NCCL: the fingerprint exchanges and other small CPU collectives.
        return "cpu:gloo,cuda:nccl"
    if implementation is CommunicationImplementation.RING or not nccl or shared_gpu is not None:
        return "gloo"
    return "cpu:gloo,cuda:nccl"

