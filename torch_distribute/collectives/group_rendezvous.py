"""``Rendezvous``: how a ``WorkerGroup`` meets its workers and makes its process groups.

At the chief's c10d ``TCPStore`` (connected with retries, ``store_connect.py``): every worker
compares its view of the job (``rendezvous_views.py``) and proves the job secret
(``job_auth.py``), then ``init_process_group`` runs on that store. When ``torch.distributed``
is already initialized (Ray Train, accelerate, the user's own ``init_process_group``), its
group is adopted instead: our groups are made from it, and the chief shares the address of a
store of its own over it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose: its functions' default argument
# ``group=group.WORLD`` is evaluated at import time, so importing it later (torch._dynamo
# does, at the first torch.compile or optimizer made) pins the default process group in those
# defaults. destroy_process_group cannot free it then: it is destroyed during the
# interpreter's teardown, its Gloo threads still running, which is when the rare SIGABRT at
# exit ("terminate called without an active exception") happened.
import torch.distributed.nn.functional  # noqa: F401

from torch_distribute.collectives import job_auth, job_secret, network, rendezvous_views
from torch_distribute.collectives.communication import (
    CommunicationImplementation,
    CommunicationOptions,
)
from torch_distribute.collectives.failure_diagnosis import FailureDiagnosis
from torch_distribute.collectives.liveness import Liveness
from torch_distribute.collectives.membership import Membership
from torch_distribute.collectives.process_groups import ProcessGroups
from torch_distribute.collectives.store_connect import connect_store
from torch_distribute.collectives.store_threads import StoreThreads, remember_store
from torch_distribute.errors import (
    ClusterConfigError,
    InvalidArgumentError,
    JobAuthenticationError,
    WorkerUnavailableError,
)
from torch_distribute.log import get_logger

_log = get_logger("collectives")
_JOINED_PREFIX = "td/joined/"
_GPUS_PREFIX = "td/gpus/"
_Result = TypeVar("_Result")


class Joined(NamedTuple):
    """What the rendezvous leaves the group: the chief's store (namespaced for this job) and
    the process groups."""

    store: dist.Store
    groups: ProcessGroups


class Rendezvous:
    """Meets the other workers and makes the process groups; starts this worker's heartbeat.

    Public surface: ``join(gpus)`` (``gpus``: this worker's physical GPUs), which returns
    ``Joined``; it may set ``membership.port`` (a chief's free port). The start-up's failures
    name the missing worker (``FailureDiagnosis``).

    >>> # joined = Rendezvous(membership, options, "MultiWorkerMirroredStrategy", (), threads,
    >>> #                     liveness, diagnosis).join(gpus=())
    >>> # joined.store, joined.groups.main
    """

    def __init__(self, membership: Membership, options: CommunicationOptions, strategy: str,
                 peer_addresses: Sequence[str], threads: StoreThreads, liveness: Liveness,
                 diagnosis: FailureDiagnosis) -> None:
        self._member = membership
        self._options = options
        self._strategy = strategy
        self._peer_addresses = tuple(peer_addresses)
        self._threads = threads
        self._liveness = liveness
        self._diagnosis = diagnosis
        self._secret: bytes | None = None

    def join(self, gpus: Sequence[str]) -> Joined:
        """Adopt the initialized default group, or meet at the chief's store and make it."""
        _backend(self._options.implementation, bool(gpus), None)  # what needs no other worker, first
        if dist.is_initialized():
            return self._adopt(gpus)
        return self._start(gpus)

    def _start(self, gpus: Sequence[str]) -> Joined:
        """Rendezvous at the chief's store, then make the process group and ours."""
        member, options = self._member, self._options
        rank, world_size, host = member.rank, member.world_size, member.host
        # One worker alone: nobody to authenticate (and nothing to warn about).
        self._secret = (job_secret.required_secret(host, f"The job's rendezvous (worker {rank} of {world_size})")
                        if world_size > 1 else job_secret.job_secret())
        remember_store(host, member.port)
        store = self._rendezvous()
        # Heartbeats from here on: a worker that dies during the rest of the start-up is named.
        self._liveness.start()
        try:
            shared = self._start_up_step("start-up: the GPU check", lambda: self._gpus_shared_with_others(store, gpus))
            backend = _backend(options.implementation, bool(gpus), shared)
            _choose_gloo_interface(backend, host)
            self._start_up_step("start-up: init_process_group", lambda: dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size, timeout=member.collective_timeout))
            main = dist.group.WORLD
            _log.info("worker %d of %d: process group on backend %s, rendezvous at %s:%d, timeout %ss",
                      rank, world_size, backend, host, member.port, options.timeout)
            gradient = self._gradient_group(backend)
        except BaseException:
            self._liveness.stop(wait=False)
            raise
        return Joined(store, ProcessGroups(main, gradient, uses_nccl="nccl" in backend, adopted=False))

    def _adopt(self, gpus: Sequence[str]) -> Joined:
        """Join a process group made by someone else: our collective group and a store of our
        own (for heartbeats and the rendezvous checks) made from it, then the gradient group."""
        member = self._member
        _check_adoptable(member.world_size, member.rank)
        backend = _backend(self._options.implementation, bool(gpus), None)
        main = self._adoption_step(
            "the strategy's process group", lambda: dist.new_group(backend=backend, timeout=member.collective_timeout))
        chief = member.rank == 0
        if chief:
            member.port = 0  # a free port: the existing group's store may hold the cluster's port
            store = self._connect_store(hosts_store=True)
        member.host, member.port, self._secret = self._adoption_step(
            "the address of the chief's store", lambda: self._share_store_address(main))
        remember_store(member.host, member.port)
        if not chief:
            store = self._connect_store(hosts_store=False)
        self._meet(store, hosts_store=chief)
        self._authenticate(store)
        self._liveness.start()
        try:
            gradient = self._gradient_group(backend)
        except BaseException:
            self._liveness.stop(wait=False)
            raise
        return Joined(store, ProcessGroups(main, gradient, uses_nccl="nccl" in backend, adopted=True))

    def _gradient_group(self, backend: str) -> dist.ProcessGroup:
        """Gradients travel on a group of their own, so they never interleave with other
        collectives."""
        return self._start_up_step(
            "start-up: the gradient group",
            lambda: dist.new_group(backend=backend, timeout=self._member.collective_timeout))

    def _adoption_step(self, what: str, call: Callable[[], _Result]) -> _Result:
        """``call()`` (a collective over the adopted group) within the deadline; the error
        says that some process of the group did not create the strategy."""
        member = self._member
        seconds = member.timeout + member.store_deadline
        try:
            return self._threads.within(call, seconds)
        except Exception as error:  # noqa: BLE001 - translated with what to check
            reason = f"no answer within {seconds:.0f} s" if isinstance(error, TimeoutError) else \
                f"{type(error).__name__}: {error}"
            raise WorkerUnavailableError(
                f"Worker {member.rank} of the existing process group ({member.world_size} processes) could "
                f"not make {what} together with the others ({reason}): every process of the group must "
                "create the strategy, in the same order. Collectives wait at most "
                f"{member.timeout:.0f} s (CommunicationOptions(timeout_seconds=...))."
            ) from error

    def _share_store_address(self, main: dist.ProcessGroup) -> tuple[str, int, bytes]:
        """The chief's ``(host, port)`` of its store and the secret its workers prove there (the
        job's, else a fresh one), broadcast over our group: the adopted group's processes are
        the job, so no secret need be configured for them."""
        payload = torch.zeros(4096, dtype=torch.uint8)
        if self._member.rank == 0:
            secret = job_secret.job_secret() or job_secret.new_secret().encode()
            text = json.dumps([self._member.host, self._member.port, secret.hex()]).encode()
            payload[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=main)
        host, port, secret_hex = json.loads(bytes(payload.tolist()).rstrip(b"\0"))
        return str(host), int(port), bytes.fromhex(secret_hex)

    def _start_up_step(self, what: str, call: Callable[[], _Result]) -> _Result:
        """``call()``, given ``timeout_seconds`` plus a heartbeat interval: a chief that stops
        during the start-up leaves torch's store clients blocked in ``recv`` with no deadline.
        Its errors, and running out of time, are reported naming the missing worker."""
        try:
            return self._threads.within(call, self._member.timeout + self._member.store_deadline)
        except TimeoutError as error:
            raise self._diagnosis.describe_failure(what, None) from error
        except WorkerUnavailableError:
            raise
        except Exception as error:  # noqa: BLE001 - translated with the missing worker's name
            raise self._diagnosis.describe_failure(what, error) from error

    def _rendezvous(self) -> dist.Store:
        """Meet at the chief's TCPStore; name the workers that did not turn up in time."""
        # Under torchrun the elastic agent already serves the store at MASTER_PORT.
        hosts_store = self._member.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        store = self._connect_store(hosts_store)
        self._meet(store, hosts_store)
        self._authenticate(store)
        return store

    def _authenticate(self, store: dist.Store) -> None:
        """Every worker proves the job secret before its rank is accepted (job_auth.py)."""
        member, timeout = self._member, self._member.timeout
        try:
            self._threads.within(lambda: job_auth.authenticate(store, member.rank, member.world_size, self._secret,
                                                               member.store_address, timeout),
                                 timeout + member.store_deadline)
        except JobAuthenticationError:
            raise
        except Exception as error:  # noqa: BLE001 - rewrapped with what to check
            raise WorkerUnavailableError(
                f"Worker {member.rank} could not finish proving the job secret at {member.store_address} "
                f"within {timeout:.0f} s ({error}): a worker or the chief stopped during the rendezvous. "
                "Restart the job."
            ) from error

    def _connect_store(self, hosts_store: bool) -> dist.Store:
        """Host the store (the chief), or connect to it, retried within the whole timeout."""
        member, timeout = self._member, self._member.timeout
        try:
            if hosts_store:
                # Bound to the address the job meets at (loopback for a local job), not every interface.
                listener = job_auth.listening_socket(member.host, member.port)
                raw = dist.TCPStore(member.host, member.port, member.world_size, is_master=True,
                                    timeout=member.collective_timeout, wait_for_workers=False,
                                    master_listen_fd=listener.detach() if listener is not None else None)
                member.port = raw.port  # port 0 (a single local worker) picks a free one
                store = job_auth.namespaced(raw)
            else:
                # A stopped chief accepts the connection and never answers: bounded here too.
                store = job_auth.namespaced(self._threads.within(
                    lambda: connect_store(member.host, member.port, member.world_size, timeout,
                                          waiting=f"worker {member.rank} of {member.world_size}"),
                    timeout + member.store_deadline))
                store.set_timeout(member.collective_timeout)
        except Exception as error:  # noqa: BLE001 - rewrapped with what to check
            raise WorkerUnavailableError(
                f"Worker {member.rank} could not reach the chief (worker 0) at {member.store_address} "
                f"within {timeout:.0f} s ({error}). Check that the chief is running and that every "
                "worker was started with the same cluster configuration."
            ) from error
        return store

    def _peer_name(self, rank: int) -> str:
        address = self._peer_addresses[rank] if rank < len(self._peer_addresses) else ""
        return f"worker {rank} at {address}" if ":" in address else f"worker {rank}"

    def _meet(self, store: dist.Store, hosts_store: bool) -> None:
        """Every worker publishes its view of the job and waits for all the others
        (``rendezvous_views.py``): a disagreement raises ``ClusterConfigError`` at once."""
        member, timeout = self._member, self._member.timeout
        view = rendezvous_views.own_view(member.world_size, member.rank, member.store_address, self._strategy)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's store outlives an attempt
        views = rendezvous_views.ViewExchange(store, view, hosts_store, self._peer_name, namespace=attempt)
        deadline = time.monotonic() + timeout

        def meet() -> set[int]:
            store.set(f"{_JOINED_PREFIX}{member.rank}", "1")
            views.publish()
            return views.wait_all(deadline)

        try:
            joined = self._threads.within(meet, timeout + member.store_deadline)
        except ClusterConfigError:
            raise
        except TimeoutError as error:
            raise WorkerUnavailableError(
                f"Worker {member.rank} reached the chief's store at {member.store_address}, but it "
                f"stopped answering (no reply within {timeout + member.store_deadline:.0f} s): worker 0 "
                "(the chief) is stopped or cut off. Restart the job."
            ) from error
        except Exception as error:  # noqa: BLE001 - rewrapped with what to check
            raise WorkerUnavailableError(
                f"Worker {member.rank} lost the chief's store at {member.store_address} while waiting "
                f"for the other workers ({type(error).__name__}: {error}): worker 0 (the chief) exited "
                "or is unreachable."
            ) from error
        missing = [rank for rank in range(member.world_size) if rank not in joined]
        if missing:
            raise WorkerUnavailableError(
                f"Worker {member.rank} waited {timeout:.0f} s at {member.store_address} for all "
                f"{member.world_size} workers, but {', '.join(self._peer_name(r) for r in missing)} never "
                "joined. Start every worker (same cluster configuration), or raise "
                "CommunicationOptions(timeout_seconds=...)."
            )

    def _gpus_shared_with_others(self, store: dist.Store, gpus: Sequence[str]) -> str | None:
        """Which other worker drives one of ``gpus`` (the physical GPUs of this worker), if any."""
        member = self._member
        store.set(f"{_GPUS_PREFIX}{member.rank}", json.dumps(sorted(gpus)))
        keys = [f"{_GPUS_PREFIX}{r}" for r in range(member.world_size)]
        store.wait(keys, member.collective_timeout)
        mine = set(gpus)
        for rank, key in enumerate(keys):
            common = mine.intersection(json.loads(store.get(key))) if rank != member.rank else ()
            if common:
                return f"workers {min(rank, member.rank)} and {max(rank, member.rank)} share GPU {sorted(common)[0]}"
        return None


def _check_adoptable(world_size: int, rank: int) -> None:
    """The initialized default group must be the job this worker was told about."""
    actual_world, actual_rank = dist.get_world_size(), dist.get_rank()
    if (actual_world, actual_rank) != (world_size, rank):
        raise ClusterConfigError(
            f"torch.distributed is already initialized with {actual_world} processes (this one is "
            f"rank {actual_rank}), but the cluster resolver makes this worker {rank} of {world_size}: "
            "pass no cluster_resolver to use the existing process group, or one that describes it"
        )


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
