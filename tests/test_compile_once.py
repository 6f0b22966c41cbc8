"""One compile per host (``torch_distribute/compile_once.py``): workers that reach the same
graph together compile it once, the others wait and load it from inductor's cache.

The job: ``torch-distribute launch --nproc 2`` of ``tests/workers/compile_once_job.py`` on an
empty inductor cache of its own; between them the two workers miss inductor's FX-graph cache
once per graph (the forward and its backward) and hit it once, and they end bitwise equal.
The lock itself, in one process: a graph another thread holds the lock for waits, one on
another device does not, a marked graph takes no lock, a wait gives up after inductor's lock
timeout, ``TD_COMPILE_ONCE=0`` turns it off and another value is refused.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
import time
from pathlib import Path

import proc_helpers as P
import pytest
import torch

from torch_distribute import compile_once
from torch_distribute.errors import InvalidArgumentError

REPO = Path(__file__).resolve().parents[1]
JOB = str(REPO / "tests" / "workers" / "compile_once_job.py")
RESULT_PREFIX = "COMPILEONCE "
JOB_SECONDS = 240

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    root = tmp_path_factory.mktemp("compile_once")
    env = P.clean_env(TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"), PYTHONPATH=str(REPO))
    env.pop("TD_COMPILE_ONCE", None)
    argv = ["-m", "torch_distribute.launch", "--nproc", "2", "--timeout", str(JOB_SECONDS - 20), JOB, "120"]
    with P.processes(root) as procs:
        proc = procs.spawn(argv, env, "launch")
        code = procs.wait(proc, JOB_SECONDS)
        text = procs.output(proc)
    assert code == 0, f"the job exited {code}:\n{text[-4000:]}"
    return P.parse_results(text, RESULT_PREFIX)


def test_two_workers_compile_each_graph_once_and_train_alike(job: dict[int, dict]) -> None:
    assert sorted(job) == [0, 1]
    graphs = {r["graphs"] for r in job.values()}
    assert graphs == {1}, graphs  # one dynamo graph; inductor builds its forward and backward
    assert sum(r["fx_misses"] for r in job.values()) == 2, job  # each built by one worker only
    assert sum(r["fx_hits"] for r in job.values()) == 2, job  # and loaded by the other
    assert job[0]["params"] == job[1]["params"] and job[0]["losses"] == job[1]["losses"]


# -- the lock, in one process ------------------------------------------------------------------
@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(compile_once.ENVIRONMENT_VARIABLE, raising=False)
    return tmp_path


GRAPH = torch.fx.symbolic_trace(torch.nn.ReLU())


def _lock_path(cache_dir: Path, inputs: list[torch.Tensor], options: str = "o") -> Path:
    key = compile_once.graph_key(GRAPH, inputs, options)
    path = cache_dir / "td_compile_once" / key[:2] / f"{key}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


class _Held:
    """The lock at ``path``, held by this test (as another worker would) until released."""

    def __init__(self, path: Path):
        self.descriptor = os.open(path, os.O_RDWR | os.O_CREAT)
        fcntl.flock(self.descriptor, fcntl.LOCK_EX)

    def release(self) -> None:
        os.close(self.descriptor)


def _compile_in_thread(inputs: list[torch.Tensor], calls: list[float]) -> threading.Thread:
    def compile_graph(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> str:
        calls.append(time.monotonic())
        return "built"

    thread = threading.Thread(target=compile_once.compile_shared, args=(compile_graph, GRAPH, inputs, "o"),
                              daemon=True)
    thread.start()
    return thread


def test_a_graph_being_compiled_elsewhere_waits_and_one_on_another_device_does_not(cache_dir: Path) -> None:
    on_cpu, on_meta = [torch.ones(2)], [torch.ones(2, device="meta")]
    held = _Held(_lock_path(cache_dir, on_cpu))
    waiting: list[float] = []
    other_device: list[float] = []
    try:
        waiter = _compile_in_thread(on_cpu, waiting)
        elsewhere = _compile_in_thread(on_meta, other_device)
        elsewhere.join(30)
        assert other_device and not elsewhere.is_alive()  # a different key: no wait
        time.sleep(0.5)
        assert not waiting and waiter.is_alive()  # the same key: waits for the holder
        released_at = time.monotonic()
    finally:
        held.release()
    waiter.join(30)
    assert waiting and waiting[0] >= released_at
    done = _lock_path(cache_dir, on_cpu).with_suffix(".done")
    assert done.read_text() == "cached\n"
    # Marked done: a later compile of that graph takes no lock, even while someone holds it.
    held = _Held(_lock_path(cache_dir, on_cpu))
    try:
        later: list[float] = []
        _compile_in_thread(on_cpu, later).join(30)
        assert later
    finally:
        held.release()


def test_a_graph_inductor_would_not_cache_is_marked_for_everyone_to_compile(cache_dir: Path) -> None:
    from torch._dynamo.utils import counters

    def bypassing(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> str:
        counters["inductor"]["fxgraph_cache_bypass"] += 1
        return "built"

    inputs = [torch.ones(3)]
    assert compile_once.compile_shared(bypassing, GRAPH, inputs, "o") == "built"
    done = _lock_path(cache_dir, inputs).with_suffix(".done")
    assert done.read_text().startswith("not cached")


def test_a_wait_gives_up_after_inductors_lock_timeout(cache_dir: Path) -> None:
    import torch._inductor.config as inductor_config

    inputs = [torch.ones(4)]
    held = _Held(_lock_path(cache_dir, inputs))
    try:
        started = time.monotonic()
        # torch's own patch: monkeypatch's teardown would delete the setting from torch's config
        with inductor_config.patch(file_lock_timeout=1):
            assert compile_once.compile_shared(lambda graph, example_inputs: "built", GRAPH, inputs, "o") == "built"
        assert 0.9 <= time.monotonic() - started < 20
    finally:
        held.release()
    assert not _lock_path(cache_dir, inputs).with_suffix(".done").exists()  # not compiled under the lock


def test_the_switch(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = [torch.ones(5)]
    monkeypatch.setenv(compile_once.ENVIRONMENT_VARIABLE, "0")
    assert compile_once.enabled() is False
    held = _Held(_lock_path(cache_dir, inputs))
    try:
        calls: list[float] = []
        _compile_in_thread(inputs, calls).join(30)
        assert calls  # off: no lock taken
    finally:
        held.release()
    monkeypatch.setenv(compile_once.ENVIRONMENT_VARIABLE, "yes")
    with pytest.raises(InvalidArgumentError, match="TD_COMPILE_ONCE must be 1 .* or 0"):
        compile_once.enabled()
    monkeypatch.setenv(compile_once.ENVIRONMENT_VARIABLE, "1")
    assert compile_once.enabled() is True


def test_with_inductors_caches_off_nothing_waits(cache_dir: Path) -> None:
    import torch._inductor.config as inductor_config

    # torch's own patch (a config module's attribute set and deleted by monkeypatch is gone
    # for the rest of the process, for every later compile).
    with inductor_config.patch(fx_graph_cache=False):
        assert compile_once.enabled() is False
    assert compile_once.enabled() is True


def test_the_key_names_what_decides_the_build() -> None:
    key = compile_once.graph_key
    base = key(GRAPH, [torch.ones(2)], "o")
    assert base == key(GRAPH, [torch.zeros(2)], "o")  # values do not decide the build
    assert base != key(GRAPH, [torch.ones(2, dtype=torch.float64)], "o")
    assert base != key(GRAPH, [torch.ones(2, 2).t()], "o") != key(GRAPH, [torch.ones(2, 2)], "o")  # strides
    assert base != key(GRAPH, [torch.ones(2, requires_grad=True)], "o")
    assert base != key(GRAPH, [torch.ones(2)], "other options")
    assert base != key(torch.fx.symbolic_trace(torch.nn.Tanh()), [torch.ones(2)], "o")
    with torch.no_grad():
        assert base != key(GRAPH, [torch.ones(2)], "o")
    assert json.dumps(base)  # a plain string, the same in every process


if sys.platform == "win32":  # pragma: no cover
    pytestmark = [pytestmark, pytest.mark.skip(reason="fcntl")]
