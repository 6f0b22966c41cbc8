"""Parsers for SLURM's compressed node lists and tasks-per-node lists.

SLURM describes the nodes of a job step as a *hostlist* (``SLURM_STEP_NODELIST``), e.g.
``"t02n[13,41-43]"``, and the number of tasks on each of them as a compressed list
(``SLURM_STEP_TASKS_PER_NODE``), e.g. ``"2(x3),1"``. These expand them in order, as
``scontrol show hostnames`` does (zero padding of ranges is kept; no sorting, no
de-duplication).

>>> expand_hostlist("t02n[13,41-43]")
['t02n13', 't02n41', 't02n42', 't02n43']
>>> expand_hostlist("a[1-2],b3,c[07-09]")
['a1', 'a2', 'b3', 'c07', 'c08', 'c09']
>>> expand_tasks_per_node("2(x3),1")
[2, 2, 2, 1]
"""

from __future__ import annotations

import itertools
import re

from torch_distribute.errors import ClusterConfigError

__all__ = ["expand_hostlist", "expand_tasks_per_node"]

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_top_level(hostlist: str) -> list[str]:
    """Split at commas that are not inside ``[...]``; check brackets are balanced."""
    parts: list[str] = []
    depth = 0
    current = ""
    for char in hostlist:
        if char == "[":
            if depth:
                raise ValueError("nested '[' inside a range expression")
            depth = 1
        elif char == "]":
            if not depth:
                raise ValueError("']' without a matching '['")
            depth = 0
        elif char == "," and not depth:
            if not current:
                raise ValueError("empty host name between commas")
            parts.append(current)
            current = ""
            continue
        current += char
    if depth:
        raise ValueError("'[' without a matching ']'")
    if not current:
        raise ValueError("empty host name at the end")
    parts.append(current)
    return parts


def _expand_range(expression: str) -> list[str]:
    """``"01-03,7"`` -> ``["01", "02", "03", "7"]`` (width of the lower bound kept)."""
    values: list[str] = []
    for item in expression.split(","):
        match = _RANGE.match(item.strip())
        if match is None:
            raise ValueError(f"bad range {item!r} (expected N or N-M with digits)")
        low_text, high_text = match.group(1), match.group(2)
        low = int(low_text)
        high = low if high_text is None else int(high_text)
        if high < low:
            raise ValueError(f"range {item!r} goes backwards")
        width = len(low_text)
        values.extend(str(i).zfill(width) for i in range(low, high + 1))
    return values


def _expand_host(part: str) -> list[str]:
    """One host pattern, possibly with several bracket groups (``"r[1-2]n[01-02]"``)."""
    pieces: list[list[str]] = []
    pos = 0
    while pos < len(part):
        start = part.find("[", pos)
        if start < 0:
            pieces.append([part[pos:]])
            break
        if start > pos:
            pieces.append([part[pos:start]])
        end = part.index("]", start)  # brackets were checked to be balanced
        if end == start + 1:
            raise ValueError("empty range expression '[]'")
        pieces.append(_expand_range(part[start + 1 : end]))
        pos = end + 1
    return ["".join(combo) for combo in itertools.product(*pieces)]


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a SLURM hostlist into host names, in order.

    Commas separate hosts except inside ``[...]``; a bracket holds comma-separated numbers
    and ``low-high`` ranges whose zero padding is kept (``c[07-10]`` -> ``c07 ... c10``).
    Several bracket groups in one name expand to their product, and text may follow a
    bracket (``node[1-2]-ib`` -> ``node1-ib node2-ib``).

    Raises:
        ClusterConfigError: an empty list, unbalanced brackets, or a bad range.

    >>> expand_hostlist("node7")
    ['node7']
    >>> expand_hostlist("r[1-2]n[01-02]")
    ['r1n01', 'r1n02', 'r2n01', 'r2n02']
    """
    text = hostlist.strip()
    try:
        if not text:
            raise ValueError("it is empty")
        hosts: list[str] = []
        for part in _split_top_level(text):
            hosts.extend(_expand_host(part))
        return hosts
    except ValueError as error:
        raise ClusterConfigError(f"invalid SLURM node list {hostlist!r}: {error}") from None


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
    """Expand SLURM's tasks-per-node list: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Raises:
        ClusterConfigError: any item other than ``N`` or ``N(xK)``.

    >>> expand_tasks_per_node("4")
    [4]
    """
    result: list[int] = []
    for item in tasks_per_node.split(","):
        match = _TASKS.match(item.strip())
        if match is None:
            raise ClusterConfigError(
                f"invalid SLURM tasks-per-node list {tasks_per_node!r}: bad item {item!r} "
                "(expected N or N(xK), e.g. '2(x3),1')"
            )
        result.extend([int(match.group(1))] * int(match.group(2) or 1))
    return result
