"""Who may join a job's rendezvous: the job secret proved before a rank is accepted.

torch's c10d ``TCPStore`` (the rendezvous of ``MultiWorkerMirroredStrategy`` and
``FullyShardedStrategy``) accepts any client. So, once every worker has reached the store,
the chief and each worker prove to each other that they hold the job secret
(``job_secret.py``) before the chief accepts the worker's rank, by HMAC-SHA256
challenge-response through the store::

    chief:     auth/challenge  = "hmac:" + N0                      (N0: 32 random bytes, hex)
    worker r:  auth/proof/r    = Nr + ":" + HMAC(secret, "td-worker|N0|r|Nr")
    chief:     auth/verdict/r  = "ok:" + HMAC(secret, "td-chief|N0|r|Nr")   or "refused"

A worker whose proof is wrong is refused (``JobAuthenticationError`` on both sides, and the
chief logs the refusal on ``torch_distribute.security``); a worker also refuses a chief that
cannot answer its own nonce, so an impostor hosting the store is caught too. The secret
never travels. A job without a secret writes ``"none:"`` and skips the proofs.

Every key of the job lives under ``td-job/<job id>/`` (``namespaced``): the job id is
``TD_JOB_ID`` (``torch-distribute launch`` sets a fresh one), else torchrun's or SLURM's job
id, with the restart count; two jobs sharing an address never read each other's keys.

``listening_socket`` binds the chief's store to the address the job meets at (loopback
for a job on 127.0.0.1) instead of torch's every-interface default.

What this cannot close (torch's, documented in docs/security.md): the store itself answers
anyone who reaches it (it can be read, written, or flooded), and Gloo's links carry no
authentication; a process that reaches the job's ports can disturb it (deny service), but
no rank is accepted without the proof.

>>> sign(b"0123456789abcdef", "td-worker", "n0", 1, "n1") == sign(b"0123456789abcdef", "td-worker", "n0", 1, "n1")
True
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from torch_distribute.collectives.job_secret import is_local_address, logger
from torch_distribute.errors import JobAuthenticationError

__all__ = ["authenticate", "job_namespace", "listening_socket", "namespaced", "sign"]

_CHALLENGE = "auth/challenge"
_PROOF = "auth/proof/"
_VERDICT = "auth/verdict/"
_SEEN = "auth/seen/"
_REFUSED = "refused"


def job_namespace(environ: Mapping[str, str] | None = None) -> str:
    """``td-job/<job id>/``: the prefix of every store key of this job."""
    environ = os.environ if environ is None else environ
    job = next((environ[name].strip() for name in ("TD_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
                if environ.get(name, "").strip()), "default")
    restart = next((environ[name].strip() for name in ("TD_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")
                    if environ.get(name, "").strip()), "0")
    return f"td-job/{job}/{restart}/"


def namespaced(store: Any) -> Any:
    """``store`` with every key under this job's namespace (``dist.PrefixStore``)."""
    return dist.PrefixStore(job_namespace(), store)


def listening_socket(host: str, port: int) -> socket.socket | None:
    """A listening socket for the chief's store bound to ``host`` (loopback, or a literal address
    of this machine) rather than every interface; ``None`` where that is not sure to reach the
    peers (a host *name*: it may resolve differently on them), leaving torch's default."""
    address = "127.0.0.1" if host.strip().lower() == "localhost" else host.strip("[]")
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    except ValueError:
        return None
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(512)
    except OSError:
        listener.close()
        if is_local_address(host):
            raise
        return None  # not an address of this machine (NAT, a proxy): torch's default
    return listener


def sign(secret: bytes, role: str, challenge: str, rank: int, nonce: str) -> str:
    """HMAC-SHA256 (hex) of ``role|challenge|rank|nonce`` under ``secret``."""
    message = f"{role}|{challenge}|{rank}|{nonce}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _get(store: Any, key: str, timeout: float) -> str:
    store.wait([key], datetime.timedelta(seconds=timeout))
    return store.get(key).decode(errors="replace")


def authenticate(store: Any, rank: int, world_size: int, secret: bytes | None, where: str,
                 timeout: float) -> None:
    """Prove (worker) or check (chief, ``rank == 0``) the job secret through ``store``.

    ``where``: the store's address, for messages. Raises ``JobAuthenticationError`` for a
    refused worker (on the chief and on that worker), for a chief that does not prove the
    secret, and when only some processes have one.
    """
    if rank == 0:
        _check_workers(store, world_size, secret, where, timeout)
    else:
        _prove(store, rank, secret, where, timeout)


def _check_workers(store: Any, world_size: int, secret: bytes | None, where: str, timeout: float) -> None:
    challenge = secrets.token_hex(32)
    store.set(_CHALLENGE, f"{'hmac' if secret is not None else 'none'}:{challenge}")
    if secret is None or world_size == 1:
        return
    refused: list[int] = []
    for rank in range(1, world_size):
        nonce, _, proof = _get(store, f"{_PROOF}{rank}", timeout).partition(":")
        if proof and hmac.compare_digest(proof, sign(secret, "td-worker", challenge, rank, nonce)):
            store.set(f"{_VERDICT}{rank}", "ok:" + sign(secret, "td-chief", challenge, rank, nonce))
        else:
            refused.append(rank)
            store.set(f"{_VERDICT}{rank}", _REFUSED)
            logger.warning("Rendezvous at %s: refused the process claiming worker %d: it did not prove "
                           "the job secret (%s).", where, rank, "it has none" if nonce == "none" else "wrong proof")
    if refused:
        # Give the refused their verdict before this process (and the store) goes.
        with contextlib.suppress(Exception):
            store.wait([f"{_SEEN}{rank}" for rank in refused], datetime.timedelta(seconds=min(5.0, timeout)))
        raise JobAuthenticationError(
            f"The chief refused worker(s) {', '.join(map(str, refused))} at the rendezvous ({where}): "
            "they did not prove the job secret. Every process of the job needs the same "
            "TD_JOB_SECRET or TD_JOB_SECRET_FILE; a process that has a different one is not "
            "part of this job (or is an intruder: see the torch_distribute.security log)."
        )


def _prove(store: Any, rank: int, secret: bytes | None, where: str, timeout: float) -> None:
    mode, _, challenge = _get(store, _CHALLENGE, timeout).partition(":")
    if mode == "none":
        if secret is not None:
            raise JobAuthenticationError(
                f"Worker {rank} has a job secret, but the chief hosting the rendezvous at {where} has "
                "none: give every process the same TD_JOB_SECRET or TD_JOB_SECRET_FILE.")
        return
    if secret is None:
        store.set(f"{_PROOF}{rank}", "none:")
        raise JobAuthenticationError(
            f"The chief at {where} requires the job secret, and worker {rank} has none: give every "
            "process the same TD_JOB_SECRET or TD_JOB_SECRET_FILE.")
    nonce = secrets.token_hex(32)
    store.set(f"{_PROOF}{rank}", f"{nonce}:{sign(secret, 'td-worker', challenge, rank, nonce)}")
    verdict = _get(store, f"{_VERDICT}{rank}", timeout)
    store.set(f"{_SEEN}{rank}", "1")
    if verdict == _REFUSED:
        raise JobAuthenticationError(
            f"The chief at {where} refused worker {rank}: its job secret differs from the chief's. "
            "Give every process the same TD_JOB_SECRET or TD_JOB_SECRET_FILE.")
    answer = verdict.partition(":")[2]
    if not hmac.compare_digest(answer, sign(secret, "td-chief", challenge, rank, nonce)):
        logger.warning("Rendezvous at %s: the process hosting the store did not prove the job secret; "
                       "worker %d left.", where, rank)
        raise JobAuthenticationError(
            f"The process hosting the rendezvous store at {where} did not prove the job secret: it is "
            f"not this job's chief. Worker {rank} did not join; check the address, and that every "
            "process has the same TD_JOB_SECRET or TD_JOB_SECRET_FILE.")
