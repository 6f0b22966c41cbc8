"""Marks every test of a module that starts processes ``serial``.

``make test`` runs the suite in two passes: ``-m "not serial" -n 2`` (in-process tests on two
pytest-xdist workers: much of their time is single-threaded Python, import and compilation)
and then ``-m serial`` alone, so that tests starting worker processes (two or three per job,
with deadlines and heartbeats) keep both cores and their timing. A module is serial when
its source starts processes in any of the ways below; a new test file that does gets the
mark by itself. ``pytestmark = pytest.mark.serial`` marks one by hand.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

STARTS_PROCESSES = re.compile(
    r"\b(subprocess|Popen|proc_helpers|mw_helpers|multiprocessing|run_local_cluster"
    r"|create_in_process_cluster|launcher import|mpirun|srun|ray)\b"
)


@cache
def _starts_processes(path: Path) -> bool:
    try:
        return bool(STARTS_PROCESSES.search(path.read_text(encoding="utf-8")))
    except OSError:
        return True


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _starts_processes(Path(str(item.path))):
            item.add_marker(pytest.mark.serial)
