"""The job secret: what every process of a job holds and nothing outside it does.

Every process of a job proves it holds the secret before the others accept it (at the
rendezvous, ``job_auth.py``; on the parameter-server transport). It comes from, in order:

- ``TD_JOB_SECRET``: the secret itself (at least 16 characters). ``torch-distribute launch``
  (one node) and ``td.ps.create_in_process_cluster`` make one per job and give it to every
  process they start.
- ``TD_JOB_SECRET_FILE``: the path of a file holding it, readable by its owner only (mode
  ``0600`` or ``0400``): a file that group or others may read is refused. The usual form for
  a job across hosts: one file, copied to (or shared with) every host.

A job whose processes meet on another host (any address but a loopback one) must have one:
``ClusterConfigError`` otherwise, unless ``TD_INSECURE=1`` says the network is trusted, which
is logged as a warning on the ``torch_distribute.security`` logger. A job on loopback without
one runs unauthenticated (other local users could join it) and logs that warning too.

>>> secret = new_secret()
>>> job_secret({"TD_JOB_SECRET": secret}) == secret.encode()
True
>>> job_secret({}) is None
True
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import stat
from collections.abc import Mapping

from torch_distribute.errors import ClusterConfigError

__all__ = [
    "ENV_INSECURE",
    "ENV_SECRET",
    "ENV_SECRET_FILE",
    "MIN_SECRET_LENGTH",
    "insecure_allowed",
    "is_local_address",
    "job_secret",
    "logger",
    "new_secret",
    "required_secret",
]

ENV_SECRET = "TD_JOB_SECRET"
ENV_SECRET_FILE = "TD_JOB_SECRET_FILE"
ENV_INSECURE = "TD_INSECURE"
MIN_SECRET_LENGTH = 16

#: Where refusals, intruders and insecure opt-outs are logged.
logger = logging.getLogger("torch_distribute.security")

_warned: set[str] = set()


def new_secret() -> str:
    """A fresh random secret (256 bits, hex)."""
    return secrets.token_hex(32)


def is_local_address(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a literal loopback address (a job on one machine).

    A host *name* that resolves to loopback here may name another address on the peers, so
    only these count.

    >>> is_local_address("127.0.0.1"), is_local_address("::1"), is_local_address("node0")
    (True, True, False)
    """
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _read_secret_file(path: str) -> bytes:
    try:
        info = os.stat(path)
    except OSError as error:
        raise ClusterConfigError(f"{ENV_SECRET_FILE}={path!r} cannot be read ({error}).") from error
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ClusterConfigError(
            f"{ENV_SECRET_FILE}={path!r} may be read by other users (mode {stat.filemode(info.st_mode)}); "
            f"make it readable by its owner only: chmod 600 {path}"
        )
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise ClusterConfigError(
            f"{ENV_SECRET_FILE}={path!r} belongs to another user (uid {info.st_uid}); the secret "
            "file must belong to the user running the job."
        )
    with open(path, "rb") as file:
        return file.read().strip()


def job_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The job secret from ``TD_JOB_SECRET`` or ``TD_JOB_SECRET_FILE`` (``None`` if neither is
    set); ``ClusterConfigError`` for a file others may read, or a secret under 16 characters."""
    environ = os.environ if environ is None else environ
    value = environ.get(ENV_SECRET, "").strip()
    source = ENV_SECRET
    secret = value.encode() if value else None
    path = environ.get(ENV_SECRET_FILE, "").strip()
    if secret is None and path:
        secret, source = _read_secret_file(path), f"{ENV_SECRET_FILE}={path!r}"
    if secret is not None and len(secret) < MIN_SECRET_LENGTH:
        raise ClusterConfigError(
            f"The job secret from {source} has {len(secret)} characters; use at least "
            f"{MIN_SECRET_LENGTH} random ones, e.g. python -c 'import secrets; print(secrets.token_hex(32))'."
        )
    return secret


def insecure_allowed(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``TD_INSECURE`` is set to ``1``/``true``/``yes`` (the network is trusted)."""
    environ = os.environ if environ is None else environ
    return environ.get(ENV_INSECURE, "").strip().lower() in ("1", "true", "yes")


def required_secret(host: str, what: str, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The job secret of a job whose processes meet at ``host``; ``None`` runs unauthenticated.

    ``what`` names the job in messages (``"MultiWorkerMirroredStrategy"``). A job at a
    non-loopback ``host`` without a secret raises ``ClusterConfigError`` unless
    ``TD_INSECURE=1``; running without one logs a warning on ``torch_distribute.security``.
    """
    secret = job_secret(environ)
    if secret is not None:
        return secret
    if is_local_address(host):
        reason = (f"{what} at {host} has no job secret ({ENV_SECRET} or {ENV_SECRET_FILE}): any "
                  "process of this machine, other users' included, can join it. torch-distribute "
                  "launch and td.ps.create_in_process_cluster give their jobs one.")
    elif insecure_allowed(environ):
        reason = (f"{ENV_INSECURE}=1: {what} at {host} runs without a job secret; any process that "
                  "can reach it on the network can join it and run code in it.")
    else:
        raise ClusterConfigError(
            f"{what} meets at {host}, another host, but has no job secret: without one, any process "
            f"that reaches {host} could join the job and run code in it. Give every process the same "
            f"secret: {ENV_SECRET_FILE}=/path/to/file (mode 600; e.g. python -c 'import secrets; "
            f"print(secrets.token_hex(32))' > file) or {ENV_SECRET}=... . On a network you trust "
            f"completely, {ENV_INSECURE}=1 runs without one."
        )
    if reason not in _warned:
        _warned.add(reason)
        logger.warning(reason)
    return None
