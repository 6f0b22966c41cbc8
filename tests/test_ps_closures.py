"""Scheduled functions travel the way users write them (issue 15, item 3).

Closures, lambdas and functions defined under ``if __name__ == "__main__":`` go by value
(cloudpickle); modules, optimizers and per-worker iterators they capture go as references;
what cannot travel (a lock, an open file, a GPU tensor) is refused on the coordinator,
naming it. The job runs the tutorial's single-program form, so its workers never run the
script: every function has to arrive by value.
"""

from __future__ import annotations

import functools
import io
import json
import os
import threading

import pytest
import torch
from proc_helpers import clean_env, processes
from torch import nn

import torch_distribute as td
from torch_distribute.ps import pickling

JOB = os.path.join(os.path.dirname(__file__), "workers", "ps_closures_job.py")


def _no_references(obj):
    return None


def _refusal(fn, *args, **kwargs) -> str:
    with pytest.raises(td.InvalidArgumentError) as raised:
        pickling.dumps_call(fn, args, kwargs, _no_references)
    return str(raised.value)


def _roundtrip(fn):
    return pickling.loads(pickling.dumps(fn, _no_references, "f"), lambda ref: None)


def test_closures_and_lambdas_travel_by_value():
    scale = 3

    def make(offset):
        return lambda x: x * scale + offset

    assert _roundtrip(make(1))(2) == 7
    assert _roundtrip(functools.partial(make(0), 5))() == 15


def test_references_apply_inside_closure_cells_and_globals():
    sentinel = object()  # stands for a module made in scope
    refs = []

    def reference(obj):
        return ("module", 7) if obj is sentinel else None

    def step():
        return sentinel

    payload = pickling.dumps_call(step, (), {}, reference)
    fn, _, _ = pickling.loads(payload, lambda ref: refs.append(ref) or "worker copy")
    assert fn() == "worker copy" and refs == [("module", 7)]


def test_captured_lock_is_named():
    lock = threading.Lock()

    def step():
        return lock.locked()

    message = _refusal(step)
    assert "`lock` (captured by" in message and "_thread.lock" in message and "step" in message


def test_open_file_in_an_argument_or_a_nested_closure_is_named(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("x\n")
    with open(path) as handle:
        message = _refusal(len, handle)
        assert "args[0] is a _io.TextIOWrapper" in message and "open file" in message

        def helper():
            return handle.read()

        def outer():
            return helper()

        message = _refusal(outer)
        assert "`handle` (captured by" in message and "`helper` (captured by" in message
    assert "kwargs['data']" in _refusal(len, data=io.TextIOWrapper(io.BufferedReader(io.FileIO(path))))


def test_module_made_outside_the_scope_keeps_its_own_message():
    plain = nn.Linear(2, 2)

    def reference(obj):
        if obj is plain:
            raise td.InvalidArgumentError("not created inside strategy.scope()")
        return None

    with pytest.raises(td.InvalidArgumentError, match="strategy.scope"):
        pickling.dumps_call(lambda: plain(torch.ones(2)), (), {}, reference)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_tensor_is_refused():
    weights = torch.ones(2, device="cuda")
    assert "`weights`" in _refusal(lambda: weights.sum())


def test_function_not_importable_on_the_worker_explains():
    payload = pickling.dumps_call(test_captured_lock_is_named, (), {}, _no_references)
    payload = payload.replace(b"test_ps_closures", b"test_ps_gone_away")
    with pytest.raises(td.InvalidArgumentError, match="importable on every worker"):
        pickling.loads(payload, lambda ref: None)


@pytest.mark.timeout(120)
def test_single_program_job_runs_closures_lambdas_and_main_functions(tmp_path):
    with processes(tmp_path) as procs:
        proc = procs.spawn([JOB], clean_env(), "coordinator")
        code = procs.wait(proc, 100)
        text = procs.output(proc)
    assert code == 0, text[-4000:]
    result = json.loads(text.split("RESULT ", 1)[1].splitlines()[0])
    # train_step, a __main__ function, ran on the workers; which worker takes a function is the
    # scheduler's choice (on loaded cores one took all 8). That both workers can run __main__
    # functions shows below: each built its dataset from a __main__ closure.
    assert result["workers"] and set(result["workers"]) <= {0, 1}
    assert result["weight_after_8"] == [-8.0, -8.0, -8.0]  # 8 SGD steps of exactly -1
    assert result["weight_after_closure"] == [-9.0, -8.0, -8.0]
    assert result["lambda"] == 11.0  # 5 * SCALE + 1: the chief global travelled
    assert result["lambda_reads_model"] == -25.0
    # A closure per worker, each worker's stream from its own start (10 and 110).
    values = result["from_datasets"]
    low, high = [v for v in values if v < 100], [v for v in values if v >= 100]
    assert len(values) == 6 and low == list(range(10, 10 + len(low)))
    assert high == list(range(110, 110 + len(high)))
    assert "the global `lock`" in result["lock"] and "_thread.lock" in result["lock"]
    assert "the global `log`" in result["file"] and "open file" in result["file"]
    assert "dataset function" in result["dataset_lock"] and "`lock`" in result["dataset_lock"]
    assert result["after_refusals"] == 2.0
