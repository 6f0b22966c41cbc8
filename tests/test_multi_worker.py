"""MultiWorkerMirroredStrategy with real worker processes on loopback (Gloo, CPU).

Three training jobs run once per module and are checked for many properties each (workers
are expensive to start: importing torch takes seconds):

- ``2x1``: 2 workers x 1 CPU replica, started by the launcher with a TF_CONFIG per worker;
- ``2x2``: 2 workers x 2 CPU replicas, started by the launcher with torchrun's variables;
  it also saves a checkpoint (every worker calls ``save``);
- ``3x1``: a chief and 2 workers x 1 replica, started here with a TF_CONFIG each; it also
  restores the ``2x2`` checkpoint.

Each worker (``tests/multiworker/mw_job.py``) prints one JSON line. Then: failures (a
worker that exits, one that stops answering, one that never starts) and the tutorial under
``python -m torch_distribute.launch``. Every test is bounded in time and kills every
process it started (process groups, and their descendants) whatever happens.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import torch_distribute as td
from torch_distribute.checkpoint.file_io import load_payload
from torch_distribute.cluster.launcher import free_ports, launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mw_helpers as H  # noqa: E402
import proc_helpers as P  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")

REPO = Path(__file__).resolve().parents[1]
JOB = str(Path(__file__).resolve().parent / "multiworker" / "mw_job.py")
FAIL = str(Path(__file__).resolve().parent / "multiworker" / "mw_fail.py")
EPOCHS = 3
STEPS_PER_EPOCH = len(H.global_batch_sizes())  # 7: six of 8 rows, one of 1 row
JOB_TIMEOUT_S = 30  # CommunicationOptions(timeout_seconds=...) in the training jobs


# -- process handling: tests/proc_helpers.py -------------------------------------------------


@pytest.fixture
def processes(tmp_path):
    with P.processes(tmp_path) as procs:
        yield procs


def _tf_config(cluster: dict[str, list[str]], task_type: str, index: int) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def _launch(argv: list[str], nproc: int, env_mode: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = launch(argv, nproc, env_mode=env_mode, grace_period=2, timeout=100,
                  extra_env={"OMP_NUM_THREADS": "1"}, stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def _job_results(text: str, errors: str, num_workers: int) -> dict[int, dict]:
    results = H.parse_results(text)
    assert sorted(results) == list(range(num_workers)), f"missing worker results:\n{text[-3000:]}\n{errors[-3000:]}"
    return results


# -- the training jobs (one per module each) -----------------------------------------------
@pytest.fixture(scope="module")
def job_2x1():
    code, out, err = _launch([JOB, "--replicas", "1", "--epochs", str(EPOCHS), "--checks",
                              "--timeout", str(JOB_TIMEOUT_S)], 2, "tf_config")
    assert code == 0, err[-4000:]
    return {"workers": 2, "replicas": 1, "mode": "tf_config", "results": _job_results(out, err, 2)}


@pytest.fixture(scope="module")
def job_2x2(tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("mw_ckpt")
    code, out, err = _launch([JOB, "--replicas", "2", "--epochs", str(EPOCHS), "--checks",
                              "--timeout", str(JOB_TIMEOUT_S), "--save-dir", str(save_dir)],
                             2, "torchrun")
    assert code == 0, err[-4000:]
    return {"workers": 2, "replicas": 2, "mode": "torchrun", "results": _job_results(out, err, 2),
            "save_dir": save_dir}


@pytest.fixture(scope="module")
def job_3x1(job_2x2, tmp_path_factory):
    """A chief and two workers (TF_CONFIG), restoring the checkpoint of the 2x2 job first."""
    ckpt = td.latest_checkpoint(job_2x2["save_dir"] / "inside" / "w0")
    assert ckpt is not None
    ports = free_ports(3)
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"],
               "worker": [f"127.0.0.1:{ports[1]}", f"127.0.0.1:{ports[2]}"]}
    tasks = [("chief", 0), ("worker", 0), ("worker", 1)]
    argv = [JOB, "--replicas", "1", "--epochs", str(EPOCHS), "--checks",
            "--timeout", str(JOB_TIMEOUT_S), "--restore", ckpt]
    with P.processes(tmp_path_factory.mktemp("mw_3x1")) as procs:
        started = [procs.spawn(argv, P.clean_env(TF_CONFIG=_tf_config(cluster, t, i)), f"{t}{i}")
                   for t, i in tasks]
        deadline = time.monotonic() + 100
        codes = [procs.wait(p, deadline - time.monotonic()) for p in started]
        text = "".join(procs.output(p) for p in started)
    assert codes == [0, 0, 0], text[-4000:]
    return {"workers": 3, "replicas": 1, "mode": "tf_config", "results": _job_results(text, "", 3)}


JOBS = ["job_2x1", "job_2x2", "job_3x1"]


@pytest.fixture(params=JOBS)
def job(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def reference():
    return H.train_reference(EPOCHS)


def _no_errors(job: dict, *sections: str) -> None:
    """The worker sections a test reads ran without raising on every worker."""
    for rank, result in job["results"].items():
        for name in sections:
            assert name not in result["errors"], f"worker {rank}, {name}: {result['errors'][name]}"
            assert name in result, f"worker {rank} did not run {name}"


# -- 1. equivalence ---------------------------------------------------------------------------
@pytest.mark.timeout(200)
def test_parameters_identical_on_all_workers_and_equal_to_one_process(job, reference):
    _no_errors(job, "train")
    results = job["results"]
    chief = results[0]["train"]
    assert chief["init"] == reference["init"]  # the chief's seed is the reference's
    for rank, result in results.items():
        train = result["train"]
        assert train["steps_per_epoch"] == [STEPS_PER_EPOCH] * EPOCHS
        assert train["params"] == chief["params"], f"worker {rank} differs from the chief"  # bitwise
        assert all(copy == train["params"] for copy in train["copies"])  # every local replica
        assert train["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        assert train["metric"] == pytest.approx(reference["metric"], abs=1e-5)
    torch.testing.assert_close(torch.tensor(chief["params"]), torch.tensor(reference["params"]),
                               rtol=0, atol=1e-5)
    assert chief["params"] != reference["init"]  # it did train


@pytest.mark.timeout(200)
def test_2x2_equals_mirrored_strategy_with_4_replicas(job_2x2):
    _no_errors(job_2x2, "train")
    strategy = td.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    torch.manual_seed(H.CHIEF_SEED)
    with strategy.scope():
        model = H.make_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=H.LR)
    x, y = H.make_data()
    dist_ds = strategy.experimental_distribute_dataset(H.make_loader(x, y))
    sizes = H.global_batch_sizes()

    def step(batch, global_batch_size):
        xb, yb = batch
        loss = td.compute_average_loss(F.cross_entropy(model(xb), yb, reduction="none"),
                                       global_batch_size=global_batch_size)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(EPOCHS):
        for k, batch in enumerate(dist_ds):
            strategy.run(step, args=(batch, sizes[k]))
    torch.testing.assert_close(torch.tensor(job_2x2["results"][1]["train"]["params"]),
                               torch.tensor(H.flat(model)), rtol=0, atol=1e-5)


@pytest.mark.timeout(200)
def test_initial_values_are_the_chiefs_right_after_creation(job_2x2):
    results = job_2x2["results"]
    assert results[1]["train"]["init"] == results[0]["train"]["init"]


# -- 2. semantics across workers ----------------------------------------------------------------
@pytest.mark.timeout(200)
def test_topology_and_chief(job):
    _no_errors(job, "topology")
    workers, replicas = job["workers"], job["replicas"]
    tf_config = job["mode"] == "tf_config"
    for rank, result in job["results"].items():
        topology = result["topology"]
        assert topology["num_replicas_in_sync"] == workers * replicas
        assert topology["num_local"] == replicas
        assert topology["num_workers"] == workers
        assert topology["is_chief"] is topology["should_checkpoint"] is topology["should_save_summary"] is (rank == 0)
        assert topology["tf_config"] is tf_config
        if tf_config:
            assert topology["env_rank"] is None
        else:  # torchrun variables from the launcher
            assert topology["env_rank"] == str(rank)
    if workers == 3:  # TF_CONFIG with a chief job: chief is worker 0, worker i is i + 1
        types = [(job["results"][r]["topology"]["task_type"], job["results"][r]["topology"]["task_id"])
                 for r in range(3)]
        assert types == [("chief", 0), ("worker", 0), ("worker", 1)]


def _expected_semantics(job: dict) -> dict:
    n = job["workers"] * job["replicas"]
    ids = range(n)
    tri = n * (n + 1) / 2
    squares = sum((i + 1) ** 2 for i in ids)
    s = sum(i * (i + 1) for i in ids)  # sum over the rows of b: replica i has i + 1 rows of i
    return {"n": n, "tri": tri, "squares": squares, "s": s,
            "gather": [[float(i), 10.0 * i] for i in ids for _ in range(i + 1)],
            "all_gather": [float(i) for i in ids for _ in range(i + 1)]}


@pytest.mark.timeout(200)
def test_reduce_gather_merge_call_ids_across_workers(job):
    _no_errors(job, "semantics")
    replicas = job["replicas"]
    e = _expected_semantics(job)
    n, tri, squares, s = e["n"], e["tri"], e["squares"], e["s"]
    for rank, result in job["results"].items():
        sem = result["semantics"]
        mine = [rank * replicas + k for k in range(replicas)]  # worker offset + local id
        assert sem["ids"] == mine
        assert sem["value_fn_ids"] == mine
        assert set(sem["nums"]) == {n}
        assert sem["sum"] == [tri, squares]
        assert sem["mean"] == pytest.approx([tri / n, squares / n], abs=1e-5)
        assert sem["sum_a_axis0"] == tri + squares
        assert sem["sum_axis0"] == [s, 10.0 * s]
        assert sem["mean_axis0"] == pytest.approx([s / tri, 10 * s / tri], abs=1e-5)
        assert sem["gather"] == e["gather"]  # global replica order
        merge = sem["merge_call"]
        assert merge.get("types") == ["Tensor"], merge
        assert set(merge["values"]) == {float(n * (n - 1) / 2)}


@pytest.mark.parametrize("job_name", ["job_2x1", "job_2x2", "job_3x1"])
@pytest.mark.timeout(200)
def test_replica_context_all_reduce_all_gather_across_workers(job_name, request):
    job = request.getfixturevalue(job_name)
    _no_errors(job, "semantics")
    replicas = job["replicas"]
    e = _expected_semantics(job)
    n, tri = e["n"], e["tri"]
    expected = {
        "all_reduce_sum": [tri] * replicas,
        "all_reduce_mean": [[(n + 1) / 2, n - 1.0]] * replicas,
        "all_gather": [e["all_gather"]] * replicas,
    }
    for rank, result in job["results"].items():
        sem = result["semantics"]
        mine = [rank * replicas + k for k in range(replicas)]
        for name, values in expected.items():
            assert sem[name] == {"types": ["Tensor"], "values": values}, (rank, name)
        # d/dx of all_reduce(SUM, x*x): every replica's upstream 1, summed over n replicas.
        assert sem["all_reduce_grad"] == {"types": ["Tensor"], "values": [2.0 * (i + 1) * n for i in mine]}


# -- 3. input sharding ------------------------------------------------------------------------
def _tf_sizes(batch: int, parts: int) -> list[int]:
    """TensorFlow 2.21's split of one global batch over ``parts`` replicas (DATA, or one
    worker): in order, ``ceil(batch / parts)`` rows each, the last ones smaller or empty."""
    chunk = -(-batch // parts)
    return [max(0, min(chunk, batch - k * chunk)) for k in range(parts)]


def _tf_off_pieces(ids: list[int], global_batch: int, workers: int, replicas: int, rank: int) -> list[list[int]]:
    """TensorFlow 2.21 under OFF: a worker's rows as one stream, cut by
    ``Dataset.rebatch(batch_sizes_for_worker(G, W, R, rank))``: sizes that differ by at most one
    over the W x R replicas, rotated so this worker's come first, cycled; a size 0 is an empty
    piece; the last piece holds what is left."""
    parts = workers * replicas
    floor, extra = divmod(global_batch, parts)
    sizes = [floor + 1] * extra + [floor] * (parts - extra)
    sizes = sizes[rank * replicas:] + sizes[:rank * replicas]
    pieces, start, k = [], 0, 0
    while sizes[k % parts] <= len(ids) - start:
        pieces.append(ids[start:start + sizes[k % parts]])
        start += sizes[k % parts]
        k += 1
    if start < len(ids):
        pieces.append(ids[start:])
    return pieces


@pytest.mark.timeout(200)
def test_data_sharding_disjoint_complete_in_tf_sizes(job):
    _no_errors(job, "sharding")
    workers, replicas = job["workers"], job["replicas"]
    data = list(range(23))
    batches = [data[i:i + 7] for i in range(0, 23, 7)]  # 7, 7, 7, 2 rows
    seen = []
    for rank, result in job["results"].items():
        sharding = result["sharding"]
        assert sharding["input_context"] == [workers, rank, workers * replicas]
        assert sharding["mean"] == 11.0  # metric over every row of every worker
        assert sharding["gathered"] == batches  # gather in global replica order = global batch
        assert len(sharding["rows"]) == len(batches)
        for step, (batch, rows) in enumerate(zip(batches, sharding["rows"], strict=True)):
            sizes = _tf_sizes(len(batch), workers * replicas)
            start = sum(sizes[:rank * replicas])
            expected = []
            for size in sizes[rank * replicas:(rank + 1) * replicas]:
                expected.append(batch[start:start + size])
                start += size
            assert rows == expected, f"worker {rank}, step {step}"
            seen.extend(i for replica_rows in rows for i in replica_rows)
    assert sorted(seen) == data  # each row exactly once


@pytest.mark.timeout(200)
def test_data_sharding_global_batch_7_on_2_workers_by_2_replicas(job_2x2):
    _no_errors(job_2x2, "sharding")
    rows = {rank: r["sharding"]["rows"] for rank, r in job_2x2["results"].items()}
    assert [len(x) for x in rows[0][0]] == [2, 2]  # TF: batch_sizes_for_worker(7, 2, 2, 0)[:2]
    assert [len(x) for x in rows[1][0]] == [2, 1]  # TF: batch_sizes_for_worker(7, 2, 2, 1)[2:]
    assert rows[0][-1] == [[21], [22]] and rows[1][-1] == [[], []]  # last batch: 2 rows


@pytest.mark.timeout(200)
def test_ragged_ends_with_auto_shard_off(job):
    """Worker w brings max(1, 3 - 2w) batches of 3 rows: the others run out first."""
    _no_errors(job, "ragged_off")
    workers, replicas = job["workers"], job["replicas"]
    counts = [max(1, 3 - 2 * w) for w in range(workers)]
    # Each worker's own batches of 3 rows (G = 3), cut as TensorFlow does, R pieces a step.
    expected_steps = {}
    for rank in range(workers):
        start = sum(counts[:rank]) * 3
        pieces = _tf_off_pieces(list(range(start, start + 3 * counts[rank])), 3, workers, replicas, rank)
        pieces += [[]] * (-len(pieces) % replicas)
        expected_steps[rank] = [pieces[k:k + replicas] for k in range(0, len(pieces), replicas)]
    steps = max(len(s) for s in expected_steps.values())
    seen, per_step = [], [[] for _ in range(steps)]
    lins = set()
    for rank, result in job["results"].items():
        ragged = result["ragged_off"]
        assert len(ragged["rows"]) == steps  # everybody stops together, nobody hangs
        for step, rows in enumerate(ragged["rows"]):
            if step < len(expected_steps[rank]):
                expected = expected_steps[rank][step]
            else:
                expected = [[] for _ in range(replicas)]  # empty batches
            assert rows == expected, f"worker {rank}, step {step}"
            for replica_rows in rows:
                seen.extend(replica_rows)
                per_step[step].extend(replica_rows)
        lins.add(tuple(ragged["lin"]))
    assert all(len(ids) <= 3 for ids in per_step)  # never more than the global batch
    assert sorted(seen) == list(range(3 * sum(counts)))
    for result in job["results"].values():
        assert result["ragged_off"]["counted"] == [float(len(ids)) for ids in per_step]
    # Gradients summed over all replicas of all workers, also in steps where some are empty.
    torch.manual_seed(0)
    lin = torch.nn.Linear(1, 1)
    sgd = torch.optim.SGD(lin.parameters(), lr=0.1)
    for ids in per_step:
        (lin(torch.tensor(ids, dtype=torch.float32).unsqueeze(1)).sum() / 3).backward()
        sgd.step()
        sgd.zero_grad()
    assert len(lins) == 1
    assert list(lins.pop()) == pytest.approx(H.flat(lin), rel=1e-6, abs=1e-7)


# -- 4. checkpoints ----------------------------------------------------------------------------
def _check_each_worker_wrote_its_copy(job: dict, where: str) -> None:
    """Each worker asked for its own directory (the tutorial's pattern): each gets a copy there,
    as in TensorFlow, the path returned exists, and the copies hold the same values."""
    _no_errors(job, "save")
    save_dir = job["save_dir"] / where
    name = "ckpt-2" if where == "inside" else "ckpt-1"
    for rank, result in job["results"].items():
        assert result["save"][where] == str(save_dir / f"w{rank}" / name)
        assert sorted(os.listdir(save_dir / f"w{rank}")) == ["checkpoint", name]
    copies = [load_payload(str(save_dir / f"w{rank}" / name))["objects"]["model"]
              for rank in job["results"]]
    assert all(torch.equal(copies[0][key], copy[key]) for copy in copies[1:] for key in copies[0])


@pytest.mark.timeout(200)
def test_each_worker_writes_its_copy_of_a_checkpoint_saved_inside_scope(job_2x2):
    _check_each_worker_wrote_its_copy(job_2x2, "inside")


@pytest.mark.timeout(200)
def test_each_worker_writes_its_copy_of_a_checkpoint_saved_in_the_training_loop(job_2x2):
    _check_each_worker_wrote_its_copy(job_2x2, "outside")


@pytest.mark.timeout(200)
def test_checkpoint_of_2_workers_restores_into_3_workers(job_2x2, job_3x1):
    _no_errors(job_2x2, "train", "save")
    _no_errors(job_3x1, "restore")
    saved = job_2x2["results"][0]
    for rank, result in job_3x1["results"].items():
        restored = result["restore"]
        assert restored["params"] == saved["train"]["params"], f"worker {rank}"
        assert all(copy == saved["train"]["params"] for copy in restored["copies"])
        assert restored["metric"] == pytest.approx(saved["save"]["metric"], abs=1e-6)
        assert restored["adam_steps"] == [EPOCHS * STEPS_PER_EPOCH]


@pytest.mark.timeout(200)
def test_checkpoint_of_2_workers_restores_into_mirrored_and_no_strategy(job_2x2):
    _no_errors(job_2x2, "train", "save")
    ckpt = td.latest_checkpoint(job_2x2["save_dir"] / "inside" / "w0")
    saved = job_2x2["results"][0]
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = H.make_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=H.LR)
        metric = td.metrics.Mean()
    td.Checkpoint(model=model, optimizer=optimizer, metric=metric).restore(ckpt).assert_consumed()
    assert H.flat(model) == saved["train"]["params"]
    for replica in strategy.experimental_local_results(model):
        assert H.flat(replica) == saved["train"]["params"]
    assert float(metric.result()) == pytest.approx(saved["save"]["metric"], abs=1e-6)

    plain = H.make_model()
    plain_optimizer = torch.optim.Adam(plain.parameters(), lr=H.LR)
    plain_metric = td.metrics.Mean()
    td.Checkpoint(model=plain, optimizer=plain_optimizer, metric=plain_metric).restore(ckpt).assert_consumed()
    assert H.flat(plain) == saved["train"]["params"]
    assert {int(s["step"]) for s in plain_optimizer.state_dict()["state"].values()} == {EPOCHS * STEPS_PER_EPOCH}
    assert float(plain_metric.result()) == pytest.approx(saved["save"]["metric"], abs=1e-6)


# -- 5. failures --------------------------------------------------------------------------------
FAIL_TIMEOUT_S = 10
START_TIMEOUT_S = 6  # for the jobs where a worker never starts
NAMES_WORKER_1 = re.compile(r"worker(\(s\))?\s+1\b")


def _start_pair(processes, *extra: str, skip: tuple[int, ...] = (),
                timeout: float = FAIL_TIMEOUT_S) -> list[subprocess.Popen | None]:
    """Two workers of ``mw_fail.py`` (those in ``skip`` never start); a full pair first meets in a
    directory, so that a late ``import torch`` on loaded cores does not count as a failure."""
    ports = free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    if not skip:
        extra = (*extra, "--ready-dir", processes.meeting_place())
    procs: list[subprocess.Popen | None] = []
    for rank in range(2):
        if rank in skip:
            procs.append(None)
            continue
        env = P.clean_env(TF_CONFIG=_tf_config(cluster, "worker", rank), MW_RANK=str(rank))
        procs.append(processes.spawn([FAIL, "--timeout", str(timeout), *extra], env, f"w{rank}"))
    return procs


def _report(text: str, code: int | None) -> dict:
    results = H.parse_results(text)
    return {"code": code, "text": text[-3000:], **(next(iter(results.values())) if len(results) == 1 else {})}


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    """All failure scenarios at once (they mostly wait); every process is killed at the end.

    exit: worker 1 dies of an uncaught exception at step 3; stop: worker 1 SIGSTOPs itself at step 3;
    kill: worker 1 SIGKILLs itself at step 3;
    stop_chief / exit_chief: the same of worker 0, which hosts the rendezvous store;
    no_worker: worker 1 never starts; no_chief: worker 0 (the chief) never starts.
    """
    with P.processes(tmp_path_factory.mktemp("mw_failures")) as procs:
        exit_pair = _start_pair(procs, "--fail-rank", "1", "--mode", "exit", "--at", "3")
        stop_pair = _start_pair(procs, "--fail-rank", "1", "--mode", "stop", "--at", "3")
        kill_pair = _start_pair(procs, "--fail-rank", "1", "--mode", "kill", "--at", "3")
        stop_chief = _start_pair(procs, "--fail-rank", "0", "--mode", "stop", "--at", "3")
        exit_chief = _start_pair(procs, "--fail-rank", "0", "--mode", "exit", "--at", "3")
        no_worker = _start_pair(procs, skip=(1,), timeout=START_TIMEOUT_S)[0]
        no_chief = _start_pair(procs, skip=(0,), timeout=START_TIMEOUT_S)[1]
        deadline = time.monotonic() + 100
        waited = {"exit": exit_pair[0], "stop": stop_pair[0], "kill": kill_pair[0], "no_worker": no_worker, "no_chief": no_chief,
                  "stop_chief": stop_chief[1], "exit_chief": exit_chief[1]}
        out = {}
        for name, proc in waited.items():
            code = procs.wait(proc, deadline - time.monotonic())
            out[name] = _report(procs.output(proc), code)
        out["exit_failing_code"] = procs.wait(exit_pair[1], deadline - time.monotonic())
        out["stopped_was_alive"] = stop_pair[1].poll() is None
    out["stopped_code_after_cleanup"] = stop_pair[1].returncode
    return out


def _check_unavailable(report: dict, phase: str) -> None:
    assert report["code"] is not None, f"still running after the deadline:\n{report['text']}"
    assert report["code"] == 17 and report.get("error") == "WorkerUnavailableError", report["text"]
    assert report["phase"] == phase, report


@pytest.mark.timeout(150)
def test_worker_that_exits_mid_training(failures):
    report = failures["exit"]
    _check_unavailable(report, "training")
    assert failures["exit_failing_code"] == 1
    assert report["step"] == 3
    assert NAMES_WORKER_1.search(report["message"]), report["message"]
    assert "exited" in report["message"]
    assert report["blocked_s"] < FAIL_TIMEOUT_S + 15  # noticed, not waited out forever


@pytest.mark.timeout(150)
def test_worker_that_stops_answering(failures):
    report = failures["stop"]
    _check_unavailable(report, "training")
    assert failures["stopped_was_alive"]  # there, but silent (SIGSTOP)
    assert failures["stopped_code_after_cleanup"] == -signal.SIGKILL  # killed by the cleanup
    assert report["step"] == 3
    assert NAMES_WORKER_1.search(report["message"]), report["message"]
    assert "stopped answering" in report["message"]
    assert FAIL_TIMEOUT_S - 1 <= report["blocked_s"] <= FAIL_TIMEOUT_S + 15


@pytest.mark.timeout(150)
def test_worker_that_is_killed(failures):
    """Gone without a word (SIGKILL): its connections closed, so not "stopped answering"."""
    report = failures["kill"]
    _check_unavailable(report, "training")
    assert report["step"] == 3
    assert NAMES_WORKER_1.search(report["message"]), report["message"]
    assert "died without exiting" in report["message"] and "stopped answering" not in report["message"]
    assert report["blocked_s"] < FAIL_TIMEOUT_S + 15


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name, how", [("stop_chief", "unreachable"), ("exit_chief", "exited")])
def test_chief_that_stops_or_dies(failures, name, how):
    """The chief hosts the store every probe asks: a stopped one accepts connections and never
    answers, yet it is named as quickly as any other worker."""
    report = failures[name]
    _check_unavailable(report, "training")
    assert report["step"] == 3
    assert re.search(r"worker(\(s\))?\s+0\b", report["message"]) and how in report["message"], report["message"]
    assert report["blocked_s"] <= FAIL_TIMEOUT_S + 6


@pytest.mark.timeout(150)
def test_worker_that_never_starts(failures):
    for name in ("no_worker", "no_chief"):
        _check_unavailable(failures[name], "start-up")
    assert failures["no_worker"]["blocked_s"] <= START_TIMEOUT_S + 10
    # torch's TCPStore client retries once after a random back-off as long as its timeout;
    # the worker gives each attempt half of timeout_seconds, so the whole wait stays bounded.
    assert failures["no_chief"]["blocked_s"] <= START_TIMEOUT_S + 10
    assert "worker 0" in failures["no_chief"]["message"].lower()  # the missing chief is named


@pytest.mark.timeout(150)
def test_chief_names_the_worker_that_never_started(failures):
    message = failures["no_worker"]["message"]
    assert NAMES_WORKER_1.search(message) and "Worker 0 could not join" not in message, message


# -- 6. the tutorial under the launcher ------------------------------------------------------------
@pytest.mark.timeout(150)
def test_tutorial_example_under_launch(processes, tmp_path):
    ckpt_dir = tmp_path / "ckpts"
    proc = processes.spawn(
        ["-m", "torch_distribute.launch", "--nproc", "2", "--timeout", "110", "--grace-period", "2",
         "examples/custom_training_loop.py", "--strategy", "multiworker", "--epochs", "1",
         "--no-progress", "--checkpoint-dir", str(ckpt_dir)],
        P.clean_env(), "launch")
    code = processes.wait(proc, 130)
    text = processes.output(proc)
    assert code == 0, text[-4000:]
    assert re.search(r"^\[rank 0\] Epoch 1, Loss: \d", text, re.M), text[-4000:]
    assert re.search(r"^\[rank 0\] Accuracy after restoring", text, re.M), text[-4000:]
    assert "[rank 1] Epoch" not in text  # only the chief logs
    assert td.latest_checkpoint(ckpt_dir) is not None
