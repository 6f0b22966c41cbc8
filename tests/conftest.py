"""Marks every test that starts processes ``serial``.

``make test`` runs the suite in two passes: ``-m "not serial" -n 2`` (in-process tests spread
one by one over two pytest-xdist workers) and then ``-m serial -n 2 --dist loadfile`` (tests
starting worker processes, two or three per job, spread file by file, so that a module-scoped
job runs once; their deadlines leave room for a neighbour's load).

A test is serial when the code it reaches starts processes in one of the ways below: its own
body, the fixtures it asks for, and the functions they call that are defined in the tests
(followed through their names, so ``_run_job()`` calling ``subprocess.run`` counts, and an
in-process test in the same file as a multi-process one does not). Where the code cannot be
read, the test is serial. ``pytestmark = pytest.mark.serial`` marks a module by hand.

Tests marked ``slow`` (minutes of inductor compilation on a cold cache) are moved to the front,
the longest declared timeout first: ``make test`` hands the in-process tests to the xdist
workers a few at a time in this order (``--dist loadgroup``), so the slow ones run side by side
at the start instead of ending the pass alone on one worker.

``torch-distribute launch`` and ``local_cluster`` fork their workers from Python's forkserver,
which imported torch once (``TD_START_METHOD=forkserver``, set here for every process the tests
start) unless ``TD_TEST_FRESH_INTERPRETERS=1``; the tests of the start methods themselves name
theirs. The workers the tests start themselves fork from this process's own forkserver
(``proc_helpers``); before a serial test this process's environment gets what those workers'
start-up environment holds (``WORKER_START_ENV``), so that launches made with it agree too.
"""

from __future__ import annotations

import inspect
import os
import re
import types
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
from proc_helpers import WORKER_START_ENV, start_forkserver

FRESH_INTERPRETERS = os.environ.get("TD_TEST_FRESH_INTERPRETERS") == "1"
if not FRESH_INTERPRETERS:
    os.environ.setdefault("TD_START_METHOD", "forkserver")

STARTS_PROCESSES = re.compile(
    r"\b(subprocess|Popen|proc_helpers|mw_helpers|multiprocessing|run_local_cluster"
    r"|create_in_process_cluster|launcher import|launch|mpirun|srun|ray"
    r"|getfixturevalue)\b"  # a fixture chosen at run time: cannot be followed
)
TESTS = Path(__file__).resolve().parent


def _defined_in_tests(obj: object) -> bool:
    try:
        return Path(inspect.getfile(obj)).resolve().is_relative_to(TESTS)  # type: ignore[arg-type]
    except (TypeError, OSError):
        return False


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _unwrap(obj: object) -> object:
    """A pytest fixture's own function (pytest 8.4+ wraps it in a definition object)."""
    for attr in ("_get_wrapped_function", "__wrapped__"):
        inner = getattr(obj, attr, None)
        if callable(inner) and attr == "_get_wrapped_function":
            return inner()
        if inner is not None:
            return inner
    return obj


@cache
def _starts_processes(function: types.FunctionType) -> bool:
    """Whether ``function`` or a function of the tests it names starts processes."""
    seen: set[types.FunctionType] = set()
    pending = [function]
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            source = inspect.getsource(current)
        except (OSError, TypeError):
            return True
        if STARTS_PROCESSES.search(source):
            return True
        names = {name for code in _code_objects(current.__code__) for name in code.co_names}
        namespaces = [current.__globals__] + [
            vars(value) for name in names
            if isinstance(value := current.__globals__.get(name), types.ModuleType) and _defined_in_tests(value)
        ]  # `H.run_job()` with `import mw_helpers as H`
        for namespace in namespaces:
            for name in names:
                pending.extend(_functions_in_tests(namespace.get(name)))
    return False


def _functions_in_tests(obj: object) -> list[types.FunctionType]:
    obj = _unwrap(getattr(obj, "__func__", obj))
    if isinstance(obj, type) and _defined_in_tests(obj):
        return [v for v in vars(obj).values() if isinstance(v, types.FunctionType)]
    if isinstance(obj, types.FunctionType) and _defined_in_tests(obj):
        return [obj]
    return []


def _fixture_functions(item: pytest.Function) -> Iterator[types.FunctionType]:
    """The fixtures of the tests that ``item`` uses, but this file's own (every test's)."""
    for name in item.fixturenames:
        for definition in item._fixtureinfo.name2fixturedefs.get(name, ()):  # pytest has no public accessor
            function = _unwrap(definition.func)
            if (isinstance(function, types.FunctionType) and _defined_in_tests(function)
                    and function.__module__ != __name__):
                yield function


def _is_serial(item: pytest.Item) -> bool:
    if not isinstance(item, pytest.Function):
        return True
    functions = _functions_in_tests(item.cls if item.cls is not None else item.obj)
    if not functions:
        return True
    return any(_starts_processes(f) for f in [*functions, *_fixture_functions(item)])


def _start_order(item: pytest.Item) -> tuple[bool, float]:
    """Slow tests first, the longest declared timeout first; the rest keep their order."""
    if item.get_closest_marker("slow") is None:
        return (True, 0.0)
    timeout = item.get_closest_marker("timeout")
    return (False, -float(timeout.args[0]) if timeout is not None and timeout.args else 0.0)


@pytest.fixture(autouse=True)
def _worker_start_environment(request: pytest.FixtureRequest) -> None:
    if not FRESH_INTERPRETERS and request.node.get_closest_marker("serial") is not None:
        # What the tests' workers get (clean_env): with it here, the launches the tests make
        # with this process's environment fork their workers too.
        os.environ.update(WORKER_START_ENV)
        start_forkserver()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _is_serial(item):
            item.add_marker(pytest.mark.serial)
    items.sort(key=_start_order)  # stable


@pytest.fixture
def eager_functions() -> Iterator[None]:
    """``td.function``s run uncompiled while the test lasts (``td.config.run_functions_eagerly``,
    as TensorFlow's guides' ports use ``tf.config.run_functions_eagerly``)."""
    import torch_distribute as td

    td.config.run_functions_eagerly(True)
    yield
    td.config.run_functions_eagerly(False)
