"""The RPC layer of parameter-server training: ``torch.distributed.rpc`` over TensorPipe.

Every task (chief, workers, parameter servers) joins one *dynamic* RPC group whose TCP
store is hosted by the chief (rank 0, at the chief's ``TF_CONFIG`` address). Dynamic
membership lets a restarted worker join again while the others keep running.

PyTorch's own dynamic join asks every member ever registered in the store for its device
map and fails when one of them is dead; a restarted worker always finds its dead
predecessor there. So tasks join with the ``TD_TENSORPIPE`` backend registered below: the
stock TensorPipe agent and the stock membership update, announced to every member that
answers (a member that does not is skipped, and forgotten locally). Only CPU tensors travel.

A task's RPC name is ``"worker:1"``; a restarted incarnation is ``"worker:1:2"`` (names and
ranks must stay unique in a group), and the current name of each task is published in the
store under ``task/<type>:<index>``.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed import rpc
from torch.distributed.rpc import api, backend_registry

__all__ = ["CHIEF", "Membership", "join", "leave", "ping", "probe", "task_key"]

CHIEF = "chief:0"
_BACKEND = "TD_TENSORPIPE"
_ANNOUNCE_TIMEOUT_S = 5.0
_lock = threading.Lock()


def task_key(task_type: str, index: int) -> str:
    return f"{task_type}:{index}"


def _announce(agent: Any) -> None:
    """Tell every live member (and ourselves) that this agent joined; skip dead members."""
    from torch.distributed.rpc._utils import _update_group_membership

    me = agent.get_worker_info()
    for info in agent.get_worker_infos():
        if info.name == me.name:
            continue
        try:
            api.rpc_sync(info.name, _update_group_membership, args=(me, [], {}, True),
                         timeout=_ANNOUNCE_TIMEOUT_S)
        except Exception:  # a dead member still listed in the store
            agent._update_group_membership(info, [], {}, False)
    agent._update_group_membership(me, [], {}, True)


def _init_backend(store: Any, name: str, rank: int, world_size: Any, rpc_backend_options: Any) -> Any:
    from torch.distributed.rpc import TensorPipeAgent
    from torch.distributed.rpc._utils import _group_membership_management

    with _group_membership_management(store, name, True):
        agent = TensorPipeAgent(store, name, rank, world_size, rpc_backend_options, {}, [])
        api._init_rpc_states(agent)
        try:
            _announce(agent)
        except Exception:
            api._finalize_shutdown()
            raise
    return agent


def _register_backend() -> Any:
    with _lock:
        if not backend_registry.backend_registered(_BACKEND):
            backend_registry.register_backend(
                _BACKEND,
                backend_registry._tensorpipe_construct_rpc_backend_options_handler,
                _init_backend,
            )
    return backend_registry.BackendType[_BACKEND]


class Membership:
    """This task's view of the group: its store client and the current names of tasks."""

    def __init__(self, store: dist.Store, name: str):
        self.store = store
        self.name = name

    def current_name(self, key: str) -> str | None:
        """The RPC name of the live incarnation of task ``key`` (``"worker:1"``), if joined."""
        full = f"task/{key}"
        try:
            if not self.store.check([full]):
                return None
            return self.store.get(full).decode()
        except Exception:
            return None


def join(task_type: str, index: int, chief_address: tuple[str, int], *, rpc_timeout: float,
         startup_timeout: float, num_threads: int = 16) -> Membership:
    """Join the group as task ``task_type:index``; the chief hosts the store and is rank 0.

    Raises whatever ``torch.distributed`` raises when the chief's store cannot be reached
    within ``startup_timeout`` seconds; callers turn it into a clear error.
    """
    host, port = chief_address
    key = task_key(task_type, index)
    is_chief = task_type == "chief"
    timeout = datetime.timedelta(seconds=startup_timeout)
    if is_chief:
        rank, name = 0, CHIEF
    else:
        # A client of the chief's store (retries until the chief is up, then bounded).
        client = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
        store = dist.PrefixStore("td_ps", client)
        incarnation = store.add(f"incarnation/{key}", 1)
        rank = store.add("next_rank", 1)
        name = key if incarnation == 1 else f"{key}:{incarnation}"
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://{host}:{port}", rpc_timeout=rpc_timeout, num_worker_threads=num_threads,
        _transports=["uv"],
    )
    rpc.init_rpc(name, backend=_register_backend(), rank=rank, world_size=None, rpc_backend_options=options)
    if is_chief:
        client = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
        store = dist.PrefixStore("td_ps", client)
    store.set(f"task/{key}", name)
    return Membership(store, name)


def leave() -> None:
    """Leave without asking anyone (members may be dead): local shutdown only."""
    try:
        rpc.shutdown(graceful=False)
    except Exception:
        pass


def _pong() -> bool:
    return True


def ping(name: str, timeout: float) -> bool:
    """Whether ``name`` answers an RPC within ``timeout`` seconds."""
    return probe(name, timeout) is None


def probe(name: str, timeout: float) -> str | None:
    """``None`` when ``name`` answers an RPC within ``timeout`` seconds; otherwise why not,
    as a short phrase: ``"closed the connection"`` (its process is gone: the connection was
    refused, reset or closed) or ``"stopped answering"`` (no answer in time), with the
    first line of the error."""
    try:
        answered = rpc.rpc_async(name, _pong, timeout=timeout).wait()
    except Exception as error:  # noqa: BLE001 - every failure is a reason
        detail = (str(error).strip().splitlines() or [type(error).__name__])[0]
        detail = detail.split(" (this error originated at")[0][:200]  # TensorPipe's source line
        lowered = detail.lower()
        if "timed out" in lowered or "timeout" in lowered:
            return f"stopped answering ({detail})"
        return f"closed the connection ({detail})"
    return None if answered else "stopped answering (no answer)"


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    end = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(interval)
