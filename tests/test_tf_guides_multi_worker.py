"""TensorFlow's two distributed guides, their multi-worker cells, on 2 real workers; and the
1-vs-N training equalities where a dataset's batch, the shard policy and the workers meet.

One job (``tests/multiworker/tf_guides_job.py``, 2 workers x 1 CPU replica, started by the
launcher) runs every cell and training here; the tests read its report. The expected values
are what TensorFlow 2.21 (CPU) printed for the same cells with ``TF_CONFIG`` naming 2 workers
(its ``MultiWorkerMirroredStrategy`` has one CPU replica per worker, as this library's).

Where the "Distributed input" guide's text and TensorFlow 2.21 disagree, the tests follow
TensorFlow 2.21: under ``AutoShardPolicy.FILE`` the guide shows worker 0's file ``[0..5]``
(batched by 4) as ``[0, 1], [2, 3], [4], [5]``; TensorFlow 2.21 gives ``[0, 1], [2, 3],
[4, 5]`` (the short batch ``[4, 5]`` fills one replica's piece first).

The trainings: the same linear model and SGD, trained by the 2 workers with
``compute_average_loss(global_batch_size=4)`` under OFF (each worker reads its own share),
FILE (4 text files, 2 per worker), DATA (one shuffled DataLoader of global batches, seeded
alike) and ``distribute_datasets_from_function`` (per-replica batches of
``ctx.get_per_replica_batch_size(4)``), then ``td.keras`` ``fit`` under OFF and FILE, must end
with the parameters of one process trained on the global batches TensorFlow forms: at each
step, every worker's next piece of ``4 / 2`` rows of its own batch (OFF, FILE), the global batch
(DATA), every worker's next per-replica batch (dataset function). Before TensorFlow's rule
was followed, OFF and FILE gave each worker its whole batch of 4 at every step: twice the
global batch against ``global_batch_size=4``, a gradient twice one device's, and no error.
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest
import torch

from torch_distribute.cluster.launcher import launch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "multiworker"))
import mw_helpers as H  # noqa: E402
import tf_guides_job as J  # noqa: E402

pytestmark = [pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups"),
              pytest.mark.timeout(150)]

WORKER = str(HERE / "multiworker" / "tf_guides_job.py")


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict[int, dict]:
    data_dir = tmp_path_factory.mktemp("tf_guides")
    J.write_files(data_dir)
    out, err = io.StringIO(), io.StringIO()
    code = launch([WORKER, str(data_dir)], 2, env_mode="torchrun", grace_period=2, timeout=120,
                  extra_env={"OMP_NUM_THREADS": "1"}, stdout=out, stderr=err)
    assert code == 0, (out.getvalue()[-4000:], err.getvalue()[-3000:])
    results = H.parse_results(out.getvalue())
    assert sorted(results) == [0, 1], out.getvalue()[-3000:]
    return results


def ok(result: dict, name: str):
    value = result[name]
    assert not (isinstance(value, dict) and "error" in value), value
    return value


# -- "Distributed training with TensorFlow" ----------------------------------------------------


def test_training_guide_cell_16_multi_worker_mirrored_strategy(job):
    # TensorFlow 2.21: num_replicas_in_sync 2, worker_devices ('/job:worker/.../device:CPU:0',).
    for rank in (0, 1):
        assert job[rank]["rank"] == rank
        assert job[rank]["dt_cell_16"] == {"replicas": 2, "workers": 2, "local_devices": ["cpu:0"]}


def test_training_guide_cell_18_nccl_on_cpu_workers_is_refused(job):
    # TensorFlow 2.21 logs "Enabled NCCL communication but no GPUs detected/specified." and
    # reduces over its ring anyway; this library refuses NCCL without GPUs (docs/porting.md).
    for rank in (0, 1):
        error = job[rank]["dt_cell_18"]
        assert error["error"] == "InvalidArgumentError"
        assert "NCCL needs CUDA devices" in error["message"] and "RING" in error["message"]


# -- "Distributed input": Sharding ---------------------------------------------------------------

# TensorFlow 2.21, 2 workers x 1 replica, batch(4); each step: this worker's replica's rows.
TF_SHARDING = {
    "OFF range12": ([[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]],
                    [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]),
    "DATA range12": ([[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [10, 11]]),
    "AUTO range12": ([[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [10, 11]]),  # not file-based: DATA
    "FILE 2 files": ([[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9], [10, 11]]),
    "AUTO 2 files": ([[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9], [10, 11]]),  # file-based: FILE
    "DATA 2 files": ([[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [10, 11]]),
}


@pytest.mark.parametrize("cell", sorted(TF_SHARDING))
def test_input_guide_sharding_as_tensorflow_splits_it(job, cell):
    for rank in (0, 1):
        assert ok(job[rank], cell) == [[rows] for rows in TF_SHARDING[cell][rank]]


@pytest.mark.parametrize("policy", ["FILE", "AUTO"])
def test_input_guide_file_sharding_with_fewer_files_than_workers_raises_on_every_worker(job, policy):
    # TensorFlow 2.21: worker 0 InvalidArgumentError "Could not apply FILE based sharding: the
    # dataset only has 1 file(s), which is not enough for the required 2 shards/workers",
    # worker 1 an aborted collective. Here: the same DatasetError on both, naming the fix.
    for rank in (0, 1):
        error = job[rank][f"{policy} 1 file"]
        assert error["error"] == "DatasetError", error
        assert "fewer files than the 2 workers" in error["message"]
        assert "AutoShardPolicy.DATA" in error["message"]
        assert job[rank]["after the errors"] == 3.0  # the workers went on in step


# -- 1 vs N: training on the global batches TensorFlow forms ------------------------------------


def _own_batches_by_step(policy: str) -> list[list[int]]:
    """OFF and FILE (and the dataset function): at step k, rows [2k, 2k + 2) of each worker's
    own rows, worker 0's first (each worker's batch of 4 makes 2 steps of 2 rows)."""
    share = J.GLOBAL_BATCH // 2
    first, second = J.worker_rows(policy, 0), J.worker_rows(policy, 1)
    return [first[k:k + share] + second[k:k + share] for k in range(0, max(len(first), len(second)), share)]


def _data_batches() -> list[list[int]]:
    order = torch.utils.data.DataLoader(range(len(J.examples()[0])), batch_size=J.GLOBAL_BATCH, shuffle=True,
                                        generator=torch.Generator().manual_seed(3))
    return [batch.tolist() for batch in order]


def _one_process(steps: list[list[int]], epochs: int = 1, mean: bool = False) -> tuple[list[float], list[float]]:
    """The parameters (and each epoch's loss, weighted by rows) of one process, no strategy,
    trained on ``steps`` (example indices of each step's global batch): the custom loops'
    ``sum / G``, or ``fit``'s mean over the step's rows."""
    x, y = J.examples()
    model = J.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=J.LR)
    losses = []
    for _ in range(epochs):
        total = 0.0
        for rows in steps:
            per_example = (model(x[rows]) - y[rows]).pow(2).squeeze(1)
            loss = per_example.mean() if mean else per_example.sum() / J.GLOBAL_BATCH
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total += loss.item() * len(rows)
        losses.append(total / sum(len(rows) for rows in steps))
    return H.flat(model), losses


def _assert_same_parameters(job: dict[int, dict], name: str, expected: list[float]) -> None:
    assert ok(job[0], name)["params"] == ok(job[1], name)["params"]  # bitwise, on both workers
    torch.testing.assert_close(torch.tensor(job[0][name]["params"]), torch.tensor(expected), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("name", "steps"), [
    ("train OFF", lambda: _own_batches_by_step("off")),
    ("train FILE", lambda: _own_batches_by_step("file")),
    ("train DATA", _data_batches),
    ("train from_function", lambda: _own_batches_by_step("function")),
], ids=["OFF", "FILE", "DATA", "from_function"])
def test_custom_loop_on_two_workers_equals_one_process_on_the_same_global_batches(job, name, steps):
    global_batches = steps()
    for rank in (0, 1):
        result = ok(job[rank], name)
        # 22 examples, G = 4: five full steps and a last one of 2 rows, 1 per worker.
        assert result["global_rows"] == [len(rows) for rows in global_batches] == [4, 4, 4, 4, 4, 2]
        assert result["local_rows"] == [2, 2, 2, 2, 2, 1]
    _assert_same_parameters(job, name, _one_process(global_batches)[0])


@pytest.mark.parametrize("policy", ["OFF", "FILE"])
def test_keras_fit_on_two_workers_equals_one_process_on_the_same_global_batches(job, policy):
    params, losses = _one_process(_own_batches_by_step(policy.lower()), epochs=2, mean=True)
    _assert_same_parameters(job, f"fit {policy}", params)
    for rank in (0, 1):
        assert job[rank][f"fit {policy}"]["loss"] == pytest.approx(losses, rel=1e-6)
