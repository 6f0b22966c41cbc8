"""The log of committed steps of a fault-tolerant job, and the history it tells.

Every worker appends one JSON line per step it commits to ``<log_dir>/worker-<slot>.jsonl``
(a replacement goes on in the file of the worker it replaces)::

    {"step": 12, "quorum": 3, "workers": [0, 2], "reads": [["#0", 1, 4]], "writer": 2}

``step``: the job's committed-step count after this step (1 for the first). ``quorum``:
torchft's quorum id, which only grows. ``workers``: the slots of the workers whose rows the
step summed, in rank order. ``reads``: what the distributed datasets handed out during the
step, as ``[dataset, pass, batch]``: the ``batch``-th global batch of the ``pass``-th pass
over ``dataset``, split over ``workers``. ``dataset`` is ``"#k"`` for the ``k``-th
distributed dataset the program made (``"#0"`` first), or the key it was made under
(``fit``'s: ``"fit/train/<epoch>"``, ``"fit/val/<epoch>"``).

``read_committed_steps`` merges the files into the job's history: one record per step, in
order. The workers of one quorum wrote the same record (else ``FaultToleranceError``). Two
quorums that committed the same step number can only happen when a worker committed a step
and was lost before any other worker took its state: the later quorum's record is the one
the surviving workers' parameters descend from, so it replaces the earlier one. A one-process
replay that trains on the ``reads`` of each record, in order, reproduces the job's
parameters (``tests/test_fault_tolerant.py`` does).

>>> import tempfile
>>> directory = tempfile.mkdtemp()
>>> log = CommittedStepLog(directory, slot=0)
>>> log.write(step=1, quorum=1, workers=[0, 1], reads=[("#0", 0, 0)])
>>> [record["reads"] for record in read_committed_steps(directory)]
[[['#0', 0, 0]]]
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Sequence
from typing import Any

from torch_distribute.errors import FaultToleranceError

__all__ = ["CommittedStepLog", "read_committed_steps"]


class CommittedStepLog:
    """Appends this worker's committed steps to ``<directory>/worker-<slot>.jsonl``."""

    def __init__(self, directory: str | os.PathLike[str], slot: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(os.fspath(directory), f"worker-{slot}.jsonl")
        self._slot = slot

    def write(self, *, step: int, quorum: int, workers: Sequence[int], reads: Sequence[Sequence[object]]) -> None:
        """One line, flushed to the OS at once (a worker killed right after still has it)."""
        record = {"step": step, "quorum": quorum, "workers": list(workers),
                  "reads": [list(read) for read in reads], "writer": self._slot}
        with open(self.path, "a", encoding="utf-8") as file:
            file.write(json.dumps(record) + "\n")


def read_committed_steps(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The job's committed steps, step 1 first, merged from every worker's file.

    Raises ``FaultToleranceError`` when workers of one quorum disagree about a step, or when
    a step is missing (no worker wrote it: a log directory from another job?).
    """
    by_step: dict[int, dict[str, Any]] = {}
    for path in sorted(glob.glob(os.path.join(os.fspath(directory), "worker-*.jsonl"))):
        with open(path, encoding="utf-8") as file:
            for line in file:
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a kill
                step = int(record["step"])
                known = by_step.get(step)
                if known is None or record["quorum"] > known["quorum"]:
                    by_step[step] = record
                elif record["quorum"] == known["quorum"] and (
                        record["workers"] != known["workers"] or record["reads"] != known["reads"]):
                    raise FaultToleranceError(
                        f"Workers {known['writer']} and {record['writer']} logged different contents for "
                        f"step {step} of quorum {record['quorum']}: {known} and {record}.")
    steps = sorted(by_step)
    missing = sorted(set(range(1, steps[-1] + 1)) - set(steps)) if steps else []
    if missing:
        raise FaultToleranceError(
            f"The committed-step log in {directory} has no record of steps {missing[:10]}: is every "
            "worker's file there?")
    return [by_step[step] for step in steps]
