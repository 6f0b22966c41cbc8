"""``ClusterSpec``: the jobs of a cluster and the ``host:port`` address of every task.

The same structure as TensorFlow's ``tf.train.ClusterSpec`` (and the ``cluster`` field of
``TF_CONFIG``): a mapping from job name (``"chief"``, ``"worker"``, ``"evaluator"``,
``"ps"``) to the addresses of that job's tasks, either as a list (task ``i`` is entry ``i``)
or in the sparse form ``{task_index: address}``.

>>> spec = ClusterSpec({"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"]})
>>> spec.jobs
['chief', 'worker']
>>> spec.num_tasks("worker"), spec.task_address("worker", 1)
(2, 'w1:2222')
>>> ClusterSpec({"worker": {1: "w1:2222"}}).task_indices("worker")
[1]
>>> bool(ClusterSpec({}))
False
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping, Sequence
from typing import Union

from torch_distribute.errors import ClusterConfigError

__all__ = ["ClusterSpec", "ClusterSpecLike", "field_path", "split_address"]

#: What every function taking a cluster accepts: a ``ClusterSpec``, the ``TF_CONFIG``-style
#: dict (dense lists or sparse ``{index: address}`` dicts), or ``None`` for an empty cluster.
ClusterSpecLike = Union["ClusterSpec", Mapping[str, Sequence[str] | Mapping[int, str]], None]


def field_path(base: str, *keys: object) -> str:
    """The name of a nested field, as errors print it: ``TF_CONFIG["cluster"]["worker"][1]``.

    >>> field_path('TF_CONFIG["cluster"]', "worker", 1)
    'TF_CONFIG["cluster"]["worker"][1]'
    """
    return base + "".join(f"[{json.dumps(key) if isinstance(key, str) else key}]" for key in keys)


def _task_index(job: str, key: object, field: str) -> int:
    """A sparse-form task key: an int, or a string of digits as JSON object keys always are."""
    where = field_path(field, job)
    if isinstance(key, bool):
        raise ClusterConfigError(
            f"{where}: cluster job {job!r} has task index {key!r}, not an integer"
        )
    if isinstance(key, int):
        index = key
    elif isinstance(key, str) and key.strip().lstrip("-").isdigit():
        index = int(key)
    else:
        raise ClusterConfigError(
            f"{where}: cluster job {job!r} has task index {key!r}; task indices must be integers "
            '(e.g. {"worker": {"0": "host:port"}})'
        )
    if index < 0:
        raise ClusterConfigError(f"{where}: cluster job {job!r} has negative task index {index}")
    return index


def _address(job: str, index: int, address: object, field: str) -> str:
    if not isinstance(address, str) or not address.strip():
        raise ClusterConfigError(
            f"{field_path(field, job, index)} is {address!r}: cluster job {job!r} task {index} "
            "needs a 'host:port' address (e.g. 'worker0:2222')"
        )
    return address


class ClusterSpec:
    """The jobs of a cluster, each an ordered set of task addresses.

    Args:
        cluster: ``{job_name: [address, ...]}``, the sparse form
            ``{job_name: {task_index: address}}`` (string indices such as ``"1"``, as JSON
            produces them, are converted to ``int``), another ``ClusterSpec`` (copied), or
            ``None`` for an empty cluster (a single local worker).
        field: what errors call ``cluster`` (``'TF_CONFIG["cluster"]'``), so that they name
            the bad field (``TF_CONFIG["cluster"]["worker"][1]``).

    Raises:
        ClusterConfigError: a job name that is not a string, a job that is neither a list nor
            a dict, a task index that is not an integer, or an address that is not a
            non-empty string. Whether an address is a valid ``host:port`` is checked by
            ``validate_cluster_spec`` (``split_address``), not here: a ``ClusterSpec`` is
            just the mapping, as in TensorFlow.

    >>> ClusterSpec({"worker": {"0": "a:1", "1": "b:1"}}).as_dict()
    {'worker': ['a:1', 'b:1']}
    >>> ClusterSpec({"worker": ["a:1"]}) == ClusterSpec({"worker": {0: "a:1"}})
    True
    """

    __slots__ = ("_jobs",)

    def __init__(self, cluster: ClusterSpecLike = None, *, field: str = "cluster") -> None:
        self._jobs: dict[str, dict[int, str]] = {}
        if cluster is None:
            return
        if isinstance(cluster, ClusterSpec):
            self._jobs = {job: dict(tasks) for job, tasks in cluster._jobs.items()}
            return
        if not isinstance(cluster, Mapping):
            raise ClusterConfigError(
                f"{field} must be a dict of job name -> list of 'host:port' addresses, "
                f"got {type(cluster).__name__}: {cluster!r}"
            )
        for job, tasks in cluster.items():
            if not isinstance(job, str) or not job.strip():
                raise ClusterConfigError(
                    f"{field}: cluster job names must be non-empty strings, got {job!r}"
                )
            if isinstance(tasks, Mapping):
                parsed: dict[int, str] = {}
                for key, address in tasks.items():
                    index = _task_index(job, key, field)
                    if index in parsed:
                        raise ClusterConfigError(
                            f"{field_path(field, job)}: cluster job {job!r} lists task index "
                            f"{index} twice"
                        )
                    parsed[index] = _address(job, index, address, field)
                self._jobs[job] = dict(sorted(parsed.items()))
            elif isinstance(tasks, Sequence) and not isinstance(tasks, str | bytes):
                self._jobs[job] = {i: _address(job, i, a, field) for i, a in enumerate(tasks)}
            else:
                raise ClusterConfigError(
                    f"{field_path(field, job)}: cluster job {job!r} must be a list of "
                    "'host:port' addresses (or a dict task index -> address), got "
                    f"{type(tasks).__name__}: {tasks!r}"
                )

    @property
    def jobs(self) -> list[str]:
        """The job names, in the order they were given."""
        return list(self._jobs)

    def _job(self, job: str) -> dict[int, str]:
        try:
            return self._jobs[job]
        except KeyError:
            raise ClusterConfigError(f"no job {job!r} in the cluster (jobs: {self.jobs})") from None

    def num_tasks(self, job: str) -> int:
        """How many tasks ``job`` has (in the sparse form: how many are listed)."""
        return len(self._job(job))

    def task_indices(self, job: str) -> list[int]:
        """The sorted task indices of ``job`` (``[0, ..., n-1]`` in the dense form)."""
        return sorted(self._job(job))

    def task_address(self, job: str, index: int) -> str:
        """The ``host:port`` address of task ``index`` of ``job``."""
        tasks = self._job(job)
        try:
            return tasks[index]
        except (KeyError, TypeError):
            raise ClusterConfigError(
                f"job {job!r} has no task {index!r} (its task indices are {sorted(tasks)})"
            ) from None

    def job_tasks(self, job: str) -> list[str | None]:
        """The addresses of ``job`` as a dense list, ``None`` where the sparse form has a gap."""
        tasks = self._job(job)
        if not tasks:
            return []
        return [tasks.get(i) for i in range(max(tasks) + 1)]

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """A plain dict: a list for a job whose indices are ``0..n-1``, else ``{index: addr}``.

        >>> ClusterSpec({"ps": {2: "p:1"}}).as_dict()
        {'ps': {2: 'p:1'}}
        """
        out: dict[str, list[str] | dict[int, str]] = {}
        for job, tasks in self._jobs.items():
            if list(tasks) == list(range(len(tasks))):
                out[job] = list(tasks.values())
            else:
                out[job] = dict(tasks)
        return out

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ClusterSpec):
            return self._jobs == other._jobs
        if isinstance(other, Mapping):
            try:
                return self._jobs == ClusterSpec(other)._jobs
            except ClusterConfigError:
                return False
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-looking value type, like a dict

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"


def split_address(address: object, *, what: str = "address") -> tuple[str, int]:
    """Split ``"host:port"`` (or ``"[v6::addr]:port"``) into ``(host, port)``, checking both.

    The one place an address is validated: cluster addresses (``validate_cluster_spec``),
    the rendezvous address, ``MASTER_ADDR``/``MASTER_PORT`` and the launcher's ``--master``
    all come here. The port must be an integer in 1..65535; the host must be non-empty,
    without spaces, and an IPv6 address must be written in brackets.

    Raises:
        ClusterConfigError: naming ``what`` (the field the address came from) and the fix.

    >>> split_address("10.0.0.1:2222")
    ('10.0.0.1', 2222)
    >>> split_address("[::1]:2222")
    ('::1', 2222)
    >>> split_address("w1:70000", what='TF_CONFIG["cluster"]["worker"][1]')
    Traceback (most recent call last):
    ...
    torch_distribute.errors.ClusterConfigError: TF_CONFIG["cluster"]["worker"][1] 'w1:70000' has port 70000, but a port must be in 1..65535
    """
    if not isinstance(address, str):
        raise ClusterConfigError(
            f"{what} is {address!r} ({type(address).__name__}), not a 'host:port' string "
            "(e.g. 'worker0:2222')"
        )
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text:
        raise ClusterConfigError(
            f"{what} {address!r} is not of the form 'host:port' (e.g. 'worker0:2222')"
        )
    if not (port_text.isascii() and port_text.isdigit()):
        raise ClusterConfigError(
            f"{what} {address!r} has port {port_text!r}, which is not an integer; write "
            "'host:port' with a port number between 1 and 65535 (e.g. 'worker0:2222')"
        )
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ClusterConfigError(
            f"{what} {address!r} has port {port}, but a port must be in 1..65535"
        )
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ClusterConfigError(
                f"{what} {address!r} has {host!r} in brackets, which is not an IPv6 address; "
                "only IPv6 addresses are written in brackets ('[::1]:2222')"
            ) from None
        return host, port
    if ":" in host:
        raise ClusterConfigError(
            f"{what} {address!r} has host {host!r}, which contains ':'; write an IPv6 address in "
            "brackets ('[::1]:2222') and leave out any scheme such as 'grpc://'"
        )
    if any(c.isspace() for c in host) or any(c in host for c in "[]/@"):
        raise ClusterConfigError(
            f"{what} {address!r} has host {host!r}, which is not a host name or IP address "
            "(no spaces, brackets, '/' or '@'); write 'host:port' (e.g. 'worker0:2222')"
        )
    return host, port
