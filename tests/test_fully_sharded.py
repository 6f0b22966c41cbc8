"""FullyShardedStrategy (FSDP2) with real worker processes on loopback (Gloo, CPU).

The model is a tiny transformer (``tests/multiworker/fs_model.py``: an embedding, 2
``nn.TransformerEncoderLayer`` blocks in an ``nn.ModuleList``, a linear head) trained with
AdamW for 3 epochs of 49 token rows in global batches of 8: the last batch has 1 row, so
one worker (two of three) gets 0 rows. Every worker seeds differently; the chief's initial
values must win.

Jobs run once per module and are checked for many properties each (a worker costs seconds
to start: importing torch):

- ``job2``: 2 workers by ``launch(..., env_mode="torchrun")``: training, what each worker
  holds, reduce/all_reduce/metrics across workers, ``td.keras.Model.fit``;
- ``job2_compiled``: the same 2 workers' training with ``@td.function`` on the step;
- ``job3``: 3 workers by ``launch(..., env_mode="tf_config")``: training, holdings, semantics;
- ``side_jobs``: 2-worker jobs started here with a TF_CONFIG each, at once: hybrid
  sharding ``mesh_shape=(2, 1)`` and ``(1, 2)``, and bf16 mixed precision;
- ``failures``: 3 workers where worker 1 SIGKILLs itself mid-training, and 2 workers where
  the chief does.

The rest runs in this process with one local worker (no launcher): equivalence, the shard
policy, ``td.function``, and the argument checks. Every multi-process test is bounded in time
and kills (and reaps) every process it started whatever happens.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard

import torch_distribute as td
from torch_distribute.cluster import SimpleClusterResolver
from torch_distribute.cluster.launcher import TORCHRUN_VARS, free_ports, launch

sys.path.insert(0, str(Path(__file__).resolve().parent / "multiworker"))
import fs_model as M  # noqa: E402
import proc_helpers as P  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups"),
    # FSDP2 warns for every root whose output is a view (a Linear on 3-D input); we never
    # modify the logits in place.
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor"),
]

REPO = Path(__file__).resolve().parents[1]
JOB = str(REPO / "tests" / "multiworker" / "fs_job.py")
FAIL = str(REPO / "tests" / "multiworker" / "fs_fail.py")
JOB_TIMEOUT_S = 60  # CommunicationOptions(timeout_seconds=...) in the training jobs
LAUNCH_TIMEOUT_S = 100  # the launcher (or the wait here) stops a job after this
FAIL_TIMEOUT_S = 10  # timeout_seconds in the failure jobs
STEPS_PER_EPOCH = len(M.global_batch_sizes())  # 7: six of 8 rows, one of 1 row
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
NAMES_WORKER = r"worker(\(s\))?\s+{}\b"


# -- process handling: tests/proc_helpers.py -------------------------------------------------
def _clean_env(**extra: str) -> dict[str, str]:
    return P.clean_env(**extra)


def _tf_config(cluster: dict[str, list[str]], index: int) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})


def _spawn_job(procs: P.Processes, nproc: int, argv: list[str], name: str) -> list[subprocess.Popen]:
    """``nproc`` workers of ``fs_job.py`` with a TF_CONFIG each (no launcher)."""
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(nproc)]}
    return [procs.spawn([JOB, *argv], _clean_env(TF_CONFIG=_tf_config(cluster, r), FS_RANK=str(r)),
                        f"{name}-w{r}") for r in range(nproc)]


def _launch(argv: list[str], nproc: int, env_mode: str, timeout: float = LAUNCH_TIMEOUT_S) -> dict:
    """Run a job under the launcher (in this process); every worker is stopped when it returns."""
    out, err = io.StringIO(), io.StringIO()
    before = set(P.descendants(os.getpid()))
    started = time.monotonic()
    try:
        code = launch([JOB, "--timeout", str(JOB_TIMEOUT_S), *argv], nproc, env_mode=env_mode,
                      grace_period=2, timeout=timeout,
                      extra_env=P.WORKER_START_ENV,
                      stdout=out, stderr=err)
    finally:
        # launch() kills its workers' groups itself; anything new still here is killed too.
        for pid in set(P.descendants(os.getpid())) - before:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, 0)
    text = out.getvalue()
    assert code == 0, f"launcher exit {code}:\n{text[-4000:]}\n{err.getvalue()[-4000:]}"
    return _results(text, nproc, time.monotonic() - started)


def _results(text: str, nproc: int, seconds: float) -> dict:
    results = M.parse_results(text)
    assert sorted(results) == list(range(nproc)), f"missing worker results:\n{text[-4000:]}"
    return {"workers": nproc, "results": results, "seconds": seconds}


def _no_errors(job: dict, *sections: str) -> None:
    """The worker sections a test reads ran without raising on every worker."""
    for rank, result in job["results"].items():
        for name in sections:
            assert name not in result["errors"], f"worker {rank}, {name}: {result['errors'][name]}"
            assert name in result, f"worker {rank} did not run {name}"


# -- the jobs (once per module each) ------------------------------------------------------------
@pytest.fixture(scope="module")
def job2():
    return _launch(["--checks", "--keras"], 2, "torchrun")


@pytest.fixture(scope="module")
def job3():
    return _launch(["--checks"], 3, "tf_config")


@pytest.fixture(scope="module")
def side_jobs(tmp_path_factory):
    """Hybrid (2, 1), hybrid (1, 2) and bf16: 2 workers each, all started at once."""
    variants = {"mesh21": ["--mesh", "2,1"], "mesh12": ["--mesh", "1,2"], "bf16": ["--bf16"]}
    started = time.monotonic()
    with P.processes(tmp_path_factory.mktemp("fs_side")) as procs:
        jobs = {name: _spawn_job(procs, 2, ["--timeout", str(JOB_TIMEOUT_S), *argv], name)
                for name, argv in variants.items()}
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        out = {}
        for name, workers in jobs.items():
            codes = []
            for proc in workers:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                codes.append(proc.poll())
            text = "".join(procs.output(p) for p in workers)
            assert codes == [0, 0], f"{name}: exit codes {codes}:\n{text[-4000:]}"
            out[name] = _results(text, 2, time.monotonic() - started)
    return out


@pytest.fixture(scope="module")
def reference():
    return M.train(None)


def _job(request, name: str) -> dict:
    if name in ("job2", "job3"):
        return request.getfixturevalue(name)
    return request.getfixturevalue("side_jobs")[name]


@contextlib.contextmanager
def _local_strategy(**kwargs):
    """A FullyShardedStrategy with one local worker in this process; its group closed after."""
    kwargs.setdefault("cluster_resolver", SimpleClusterResolver({}))
    strategy = td.FullyShardedStrategy(**kwargs)
    try:
        yield strategy
    finally:
        strategy.extended.worker_group.close()
    assert not dist.is_initialized()


def _close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-5) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=atol)


def _state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    tensors = [*model.parameters(), *(v for s in optimizer.state.values() for v in s.values()
                                       if isinstance(v, torch.Tensor))]
    return sum(t.numel() * t.element_size() for t in tensors)


# -- 1. equivalence --------------------------------------------------------------------------------
TRAINING_JOBS = ["job2", "job3", "mesh21", "mesh12"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", TRAINING_JOBS)
def test_training_equals_one_process(name, request, reference):
    """Initial values are the chief's; every worker ends with the same whole parameters, equal
    to one process's on the same global batches (1e-5); per-step global losses and the loss
    metric over every row equal too; a worker with 0 rows in the last batch takes part."""
    job = _job(request, name)
    _no_errors(job, "train")
    chief = job["results"][0]["train"]
    assert torch.equal(M.decode(chief["init"]), reference["init"])
    for rank, result in job["results"].items():
        train = result["train"]
        assert train["steps_per_epoch"] == [STEPS_PER_EPOCH] * M.EPOCHS
        assert train["init"] == chief["init"], f"worker {rank}: initial values are not the chief's"
        assert train["params"] == chief["params"], f"worker {rank} differs from the chief"  # bitwise
        assert train["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        assert train["metric"] == pytest.approx(reference["metric"], abs=1e-5)
    _close(M.decode(chief["params"]), reference["params"])
    assert not torch.equal(reference["params"], reference["init"])  # it did train
    assert reference["losses"][-1] < reference["losses"][0] / 5


@pytest.mark.timeout(120)
def test_one_local_worker_in_process_equals_one_process(monkeypatch, reference):
    for var in (*TORCHRUN_VARS, "TF_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    with _local_strategy(cluster_resolver=None) as strategy:  # no cluster: one local worker
        assert strategy.num_replicas_in_sync == 1 and strategy.extended.is_chief
        got = M.train(strategy)
        assert {type(p) for p in got["model"].parameters()} == {DTensor}
    assert got["steps_per_epoch"] == [STEPS_PER_EPOCH] * M.EPOCHS
    assert torch.equal(got["init"], reference["init"])
    _close(got["params"], reference["params"])
    assert got["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    assert got["metric"] == pytest.approx(reference["metric"], abs=1e-5)


# -- 2. what each worker holds ------------------------------------------------------------------------
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["job2", "job3", "mesh12", "mesh21"])
def test_each_worker_holds_its_share_of_parameters_and_optimizer_state(name, request, reference):
    job = _job(request, name)
    _no_errors(job, "train", "topology")
    n = job["workers"]
    replicate, shard = {"mesh21": (2, 1), "mesh12": (1, 2)}.get(name, (1, n))
    whole = _state_bytes(reference["model"], reference["optimizer"])
    numel = sum(p.numel() for p in reference["model"].parameters())
    held = 0
    for rank, result in job["results"].items():
        train, topology = result["train"], result["topology"]
        assert train["param_types"] == ["DTensor"]
        if name.startswith("mesh"):
            assert train["placements"] == ["(Replicate(), Shard(dim=0))"]
            assert train["mesh_shape"] == [[replicate, shard]]
            assert topology["mesh_dim_names"] == ["replicate", "shard"]
        else:
            assert train["placements"] == ["(Shard(dim=0),)"]
            assert train["mesh_shape"] == [[n]]
            assert topology["mesh_dim_names"] == ["shard"]
        assert topology["num_replicas_in_sync"] == topology["num_workers"] == n
        assert topology["is_chief"] is topology["should_checkpoint"] is (rank == 0)
        # The optimizer holds the model's own sharded parameters (identity), its state sharded
        # (exp_avg, exp_avg_sq; AdamW's step counters are whole scalars).
        assert train["optimizer_params_are_model_params"], f"worker {rank}"
        assert train["state_types"] == ["DTensor", "Tensor"]
        assert train["num_state_tensors"] == 3 * len(list(reference["model"].parameters()))
        assert train["grads_none"]  # zero_grad(set_to_none) freed the sharded gradients
        assert train["whole_bytes"] == whole and train["whole_param_numel"] == numel
        assert train["local_bytes"] <= whole / shard * 1.10, (rank, train["local_bytes"], whole)
        held += train["local_param_numel"]
    assert held == numel * replicate  # the shards are disjoint and cover every parameter


# -- 3. reductions and metrics across workers -----------------------------------------------------------
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["job2", "job3"])
def test_reduce_all_reduce_and_metrics_over_all_workers(name, request):
    job = _job(request, name)
    _no_errors(job, "semantics")
    n = job["workers"]
    tri = n * (n + 1) / 2
    squares = sum((i + 1) ** 2 for i in range(n))
    s = sum(i * (i + 1) for i in range(n))  # worker i has i + 1 rows of i
    values = [10.0 * i + k for i in range(n) for k in range(i + 1)]
    for rank, result in job["results"].items():
        sem = result["semantics"]
        assert sem["ids"] == rank
        assert sem["sum"] == [tri, squares]
        assert sem["mean"] == pytest.approx([tri / n, squares / n], abs=1e-6)
        assert sem["sum_axis0"] == [s, 10.0 * s]
        assert sem["mean_axis0"] == pytest.approx([s / tri, 10 * s / tri], abs=1e-5)
        assert sem["gather"] == [[float(i), 10.0 * i] for i in range(n) for _ in range(i + 1)]
        assert sem["all_reduce_sum"] == tri
        assert sem["all_reduce_mean"] == pytest.approx([(n + 1) / 2, n - 1.0])
        assert sem["all_gather"] == [float(i) for i in range(n) for _ in range(i + 1)]
        assert sem["merge_call"] == n * (n - 1) / 2
        # d/dx of all_reduce(SUM, x * x): every worker's upstream 1, summed over n workers.
        assert sem["all_reduce_grad"] == 2.0 * (rank + 1) * n
        assert sem["metric_mean"] == pytest.approx(sum(values) / len(values))
        assert sem["metric_in_run"] == pytest.approx(sum(values) / len(values))
        assert sem["metric_sum"] == pytest.approx(sum(values))
        assert sem["metric_accuracy"] == pytest.approx(n / tri)  # one right row per worker


# -- 4. a worker killed mid-training ------------------------------------------------------------------
@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    """Worker 1 of 3 SIGKILLs itself at step 3; the chief of 2 does. Survivors report once."""
    scenarios = {"worker1_of_3": (3, 1), "chief_of_2": (2, 0)}
    with P.processes(tmp_path_factory.mktemp("fs_failures")) as procs:
        started: dict[str, list[subprocess.Popen]] = {}
        for name, (n, kill) in scenarios.items():
            cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(n)]}
            meeting = ("--ready-dir", procs.meeting_place(), "--workers", str(n))
            started[name] = [
                procs.spawn([FAIL, "--timeout", str(FAIL_TIMEOUT_S), "--kill-rank", str(kill), "--at", "3", *meeting],
                            _clean_env(TF_CONFIG=_tf_config(cluster, r), FS_RANK=str(r)), f"{name}-w{r}")
                for r in range(n)]
        # Survivors linger after reporting (the chief keeps the store up): poll their output.
        deadline = time.monotonic() + 120
        out: dict[str, dict] = {}
        while time.monotonic() < deadline:
            for name, (_, kill) in scenarios.items():
                reports = {r: M.parse_results(procs.output(p)).get(r)
                           for r, p in enumerate(started[name]) if r != kill}
                if all(reports.values()):
                    out[name] = reports
            if len(out) == len(scenarios):
                break
            time.sleep(0.5)
        for name, (_, kill) in scenarios.items():
            out.setdefault(name, {"text": "".join(procs.output(p) for p in started[name])[-4000:]})
            out[name + "_killed"] = started[name][kill].poll()
    return out


def _check_survivors(failures: dict, name: str, dead: int, bound_s: float) -> None:
    reports = failures[name]
    assert "text" not in reports, f"a survivor did not report in time:\n{reports.get('text')}"
    assert failures[name + "_killed"] == -signal.SIGKILL
    for rank, report in reports.items():
        assert report["error"] == "WorkerUnavailableError", (rank, report)
        assert report["phase"] == "training" and report["step"] == 3, (rank, report)
        assert re.search(NAMES_WORKER.format(dead), report["message"]), report["message"]
        assert report["blocked_s"] <= bound_s, (rank, report["blocked_s"], report["message"])


@pytest.mark.timeout(200)
def test_killed_worker_is_named_by_every_survivor_within_the_timeout(failures):
    _check_survivors(failures, "worker1_of_3", dead=1, bound_s=FAIL_TIMEOUT_S)
    for report in failures["worker1_of_3"].values():
        assert "worker(s) 0" not in report["message"] and "worker(s) 2" not in report["message"]


@pytest.mark.timeout(200)
def test_killed_chief_is_named_by_the_survivor(failures):
    # Not within timeout_seconds: the survivor probes the dead chief's store twice (each probe
    # a TCPStore connect with a fixed 5 s timeout and one retry after a random back-off),
    # about 20 s for timeout_seconds=10; bounded all the same.
    _check_survivors(failures, "chief_of_2", dead=0, bound_s=4 * FAIL_TIMEOUT_S + 5)
    assert "the chief" in failures["chief_of_2"][1]["message"]


# -- 5. hybrid sharding: the mesh shape ---------------------------------------------------------------
def _two_worker_resolver() -> SimpleClusterResolver:
    """A 2-worker cluster whose chief does not exist: nothing may try to reach it."""
    port = free_ports(1)[0]
    return SimpleClusterResolver({"worker": [f"127.0.0.1:{port}", "127.0.0.1:1"]}, "worker", 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", [(3, 1), (1, 1), (2,), (1, 1, 2), (0, 2), (-1, -2), (2.0, 1.0),
                                   (True, 2), "21", [4, 1]], ids=repr)
def test_bad_mesh_shape_fails_before_any_rendezvous(shape):
    started = time.monotonic()
    with pytest.raises(td.InvalidArgumentError, match="mesh_shape"):
        td.FullyShardedStrategy(cluster_resolver=_two_worker_resolver(), mesh_shape=shape,
                                communication_options=td.CommunicationOptions(timeout_seconds=30))
    assert time.monotonic() - started < 5  # no wait for the absent chief
    assert not dist.is_initialized()


@pytest.mark.timeout(60)
def test_int_mesh_shape_is_an_invalid_argument():
    with pytest.raises(td.InvalidArgumentError, match="mesh_shape"):
        td.FullyShardedStrategy(cluster_resolver=_two_worker_resolver(), mesh_shape=2)


@pytest.mark.timeout(60)
def test_mesh_shape_one_by_one_with_one_worker():
    with _local_strategy(mesh_shape=(1, 1)) as strategy:
        assert tuple(strategy.extended.mesh.shape) == (1, 1)
        assert strategy.extended.mesh.mesh_dim_names == ("replicate", "shard")


# -- 6. bad arguments ---------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs, match", [
    ({"shard_policy": 3}, "shard_policy"),
    ({"shard_policy": "blocks"}, "shard_policy"),
    ({"mixed_precision": "bf16"}, "mixed_precision"),
    ({"mixed_precision": torch.bfloat16}, "mixed_precision"),
    ({"mixed_precision": {"param_dtype": torch.bfloat16}}, "mixed_precision"),
    ({"communication_options": {"timeout_seconds": 5}}, "communication_options"),
    ({"communication_options": 5}, "communication_options"),
], ids=["policy-int", "policy-str", "mp-str", "mp-dtype", "mp-dict", "options-dict", "options-int"])
def test_bad_arguments_are_invalid_arguments(kwargs, match):
    with pytest.raises(td.InvalidArgumentError, match=match):
        td.FullyShardedStrategy(cluster_resolver=_two_worker_resolver(), **kwargs)
    assert not dist.is_initialized()


@pytest.mark.timeout(60)
def test_already_initialized_torch_distributed_is_adopted_and_left_alone():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=10))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        strategy = td.FullyShardedStrategy(cluster_resolver=SimpleClusterResolver({}))
        group = strategy.extended.worker_group
        assert group.adopted and strategy.num_replicas_in_sync == 1
        group.close()
        assert dist.is_initialized()  # ours, untouched
        # A resolver that does not describe the existing group is refused.
        other = SimpleClusterResolver({"worker": ["a:1", "b:1"]}, "worker", 1)
        with pytest.raises(td.ClusterConfigError, match="already initialized with 1 processes"):
            td.FullyShardedStrategy(cluster_resolver=other)
    finally:
        dist.destroy_process_group()
        del store
    assert not dist.is_initialized()
    with _local_strategy() as strategy:  # and once it is destroyed, a strategy starts fine
        assert strategy.num_replicas_in_sync == 1


# -- the shard policy ---------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_default_and_custom_shard_policies():
    with _local_strategy() as strategy:
        with strategy.scope():
            model = M.make_model()
            M.make_optimizer(model.parameters())
        sharded = {name for name, m in model.named_modules() if isinstance(m, FSDPModule)}
        # Transformer layers (blocks of a ModuleList), the root; not small leaves.
        assert sharded == {"", "blocks.0", "blocks.1"}
    seen = []

    def only_the_head(module, name):
        seen.append(name)
        return name == "head"

    with _local_strategy(shard_policy=only_the_head) as strategy:
        with strategy.scope():
            model = M.make_model()
        # Sharded when the scope is left (no optimizer made in it).
        assert {name for name, m in model.named_modules() if isinstance(m, FSDPModule)} == {"", "head"}
        assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in model.parameters())
    assert {"head", "embed", "blocks", "blocks.0", "blocks.0.self_attn"} <= set(seen)


# -- 7. mixed precision -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bf16_one_worker():
    with _local_strategy(mixed_precision=BF16) as strategy:
        got = M.train(strategy)
        model = got["model"]
        out_dtype = model(torch.zeros(1, M.SEQ, dtype=torch.long)).dtype
    return {**got, "out_dtype": out_dtype}


@pytest.mark.timeout(240)
def test_bf16_mixed_precision_trains_and_tracks_float32(side_jobs, bf16_one_worker, reference):
    job = side_jobs["bf16"]
    _no_errors(job, "train")
    chief = job["results"][0]["train"]
    # bf16 compute, float32 sharded parameters and optimizer state (FSDP2 keeps them).
    assert bf16_one_worker["out_dtype"] == torch.bfloat16
    assert chief["param_dtypes"] == ["torch.float32"] and chief["state_dtypes"] == ["torch.float32"]
    for rank, result in job["results"].items():
        assert result["train"]["params"] == chief["params"], f"worker {rank} differs from the chief"
    losses = chief["losses"]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] / 5
    # Not bitwise one process's bf16 run: each worker's bf16 matmuls see its own rows.
    _close(torch.tensor(losses), torch.tensor(bf16_one_worker["losses"]), atol=1e-2)
    _close(M.decode(chief["params"]), bf16_one_worker["params"], atol=5e-2)
    _close(torch.tensor(losses), torch.tensor(reference["losses"]), atol=2e-2)
    _close(M.decode(chief["params"]), reference["params"], atol=5e-2)


# -- 8. a compiled step -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_td_function_step_with_one_local_worker_equals_eager(reference):
    torch._dynamo.reset()
    try:
        with _local_strategy() as strategy:
            functions = []

            def wrap(fn):
                functions.append(td.function(fn))
                return functions[-1]

            got = M.train(strategy, wrap_step=wrap)
            assert {type(p) for p in got["model"].parameters()} == {DTensor}
    finally:
        torch._dynamo.reset()
    assert functions[0].experimental_get_tracing_count() >= 1
    assert got["steps_per_epoch"] == [STEPS_PER_EPOCH] * M.EPOCHS
    _close(got["params"], reference["params"])
    assert got["losses"] == pytest.approx(reference["losses"], abs=1e-5)


@pytest.fixture(scope="module")
def job2_compiled():
    # Both workers compile cold at once: on 2 loaded cores this took over 100 s once.
    return _launch(["--compiled", "--no-train"], 2, "torchrun", timeout=2 * LAUNCH_TIMEOUT_S)


@pytest.mark.timeout(300)
def test_td_function_step_on_two_workers_equals_one_process(job2_compiled, reference):
    _no_errors(job2_compiled, "compiled")
    chief = job2_compiled["results"][0]["compiled"]
    assert torch.equal(M.decode(chief["init"]), reference["init"])
    for rank, result in job2_compiled["results"].items():
        compiled = result["compiled"]
        assert compiled["param_types"] == ["DTensor"]
        assert compiled["tracing_count"] >= 1
        assert compiled["steps_per_epoch"] == [STEPS_PER_EPOCH] * M.EPOCHS
        assert compiled["params"] == chief["params"], f"worker {rank} differs from the chief"
        assert compiled["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        assert compiled["metric"] == pytest.approx(reference["metric"], abs=1e-5)
    _close(M.decode(chief["params"]), reference["params"])


# -- 9. td.keras fit -----------------------------------------------------------------------------------
def _keras_fit_reference() -> dict:
    torch.manual_seed(M.CHIEF_SEED)
    model = td.keras.Model(M.make_model())
    model.compile(td.keras.optimizers.Adam(learning_rate=M.LR),
                  td.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    x, y = M.make_data(M.KERAS_SAMPLES)
    history = model.fit(x, y, batch_size=M.GLOBAL_BATCH, epochs=M.KERAS_EPOCHS, verbose=0,
                        validation_data=(x[:19], y[:19]))
    return {"params": M.flat(model), "history": history.history,
            "evaluate": model.evaluate(x, y, batch_size=10, verbose=0),
            "predict": model.predict(x[:7], batch_size=4, verbose=0).float().reshape(-1)}


@pytest.mark.timeout(240)
def test_keras_fit_on_two_workers_equals_one_process(job2):
    _no_errors(job2, "keras")
    want = _keras_fit_reference()
    for rank, result in job2["results"].items():
        got = result["keras"]
        assert got["param_types"] == ["DTensor"]
        _close(M.decode(got["params"]), want["params"])
        assert sorted(got["history"]) == sorted(want["history"])
        for key, values in want["history"].items():
            assert got["history"][key] == pytest.approx(values, abs=1e-5), (rank, key)
        assert got["evaluate"] == pytest.approx(want["evaluate"], abs=1e-5)
        _close(M.decode(got["predict"]), want["predict"])


@pytest.mark.timeout(60)
def test_keras_loss_of_a_worker_with_no_rows_and_per_token_targets():
    loss = td.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    values = loss.per_sample(torch.zeros(0, M.SEQ, dtype=torch.long), torch.zeros(0, M.SEQ, M.VOCAB))
    assert values.shape == (0,)


# -- shard policies and containers without a forward -----------------------------------------------------
class _BigBlocks(torch.nn.Module):
    """A ModuleList of blocks holding more than the size rule's 1M parameters in all."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(800, 800) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.timeout(60)
def test_default_policy_never_picks_a_module_list_by_size():
    with _local_strategy() as strategy:
        with strategy.scope():
            model = _BigBlocks()
            torch.optim.SGD(model.parameters(), lr=0.1)
        assert type(model.blocks).__name__ == "ModuleList"  # the container itself is not wrapped
        assert all(type(b).__name__.startswith("FSDP") for b in model.blocks)
        assert model(torch.randn(2, 800)).shape == (2, 800)


@pytest.mark.timeout(60)
def test_policy_picking_a_container_without_forward_is_refused_before_any_sharding():
    with _local_strategy(shard_policy=lambda module, name: name == "blocks") as strategy:
        with pytest.raises(td.InvalidArgumentError, match="blocks .ModuleList.*no forward"):
            with strategy.scope():
                model = _BigBlocks()
                torch.optim.SGD(model.parameters(), lr=0.1)
        assert not any(type(b).__name__.startswith("FSDP") for b in model.blocks)
