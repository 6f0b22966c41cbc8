"""Keras ``fit``/``evaluate``/``predict`` under ParameterServerStrategy (issue 15, item 2).

The steps run on the workers, scheduled by the coordinator, ``steps_per_execution`` per
scheduled function; the coordinator runs the callbacks and the History and no train step.
One coordinator program (``tests/workers/ps_fit_job.py``) with an in-process cluster of 2
workers and 1 ps; the checks that need no cluster run here.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from proc_helpers import clean_env, processes

import torch_distribute as td
from torch_distribute.keras import ps_loops

JOB = os.path.join(os.path.dirname(__file__), "workers", "ps_fit_job.py")
EPOCHS, STEPS_PER_EPOCH, STEPS_PER_EXECUTION = 2, 8, 2


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    with processes(tmp_path_factory.mktemp("ps_fit")) as procs:
        proc = procs.spawn([JOB], clean_env(), "coordinator")
        code = procs.wait(proc, 100)
        text = procs.output(proc)
        assert code == 0, text[-4000:]
    for line in text.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line[len("RESULT "):]), "output": text}
    raise AssertionError(f"no RESULT line:\n{text[-4000:]}")


@pytest.mark.timeout(120)
def test_the_workers_run_every_train_step_and_the_coordinator_none(result):
    per_epoch = [forwards[:2] for forwards in result["epoch_forwards"]]
    assert [sum(f) for f in per_epoch] == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
    # Counts are cumulative. Which worker takes a function is the scheduler's choice: the first
    # free one, and on loaded cores the worker that was ready first took all 16 (the other was
    # still starting). That every worker runs what the coordinator sends is test_ps_closures'
    # to show (each builds its dataset from a __main__ closure).
    assert all(later >= earlier for earlier, later in zip(per_epoch[0], per_epoch[1], strict=True))
    assert sum(per_epoch[1]) > sum(per_epoch[0])
    assert result["final_forwards"][2] == 0                  # no train-mode forward on the coordinator
    assert result["coordinator_train_steps"] == 0            # nor a ReplicaSteps.train_step
    # fit: 4 train + 1 validation function per epoch; evaluate(steps=4): 2 functions.
    assert sum(result["worker_stats"].values()) == EPOCHS * (STEPS_PER_EPOCH // STEPS_PER_EXECUTION + 1) + 2


@pytest.mark.timeout(120)
def test_callbacks_and_history_on_the_coordinator(result):
    history = result["history"]
    assert sorted(history) == ["loss", "mae", "val_loss", "val_mae"]
    assert all(len(values) == EPOCHS for values in history.values())
    assert history["loss"][1] < history["loss"][0]
    assert history["val_loss"][1] < history["val_loss"][0]
    # on_train_batch_end once per scheduled function (at its last step), with the metrics.
    ends = [1, 3, 5, 7]
    assert result["train_batches"] == [[b, ["loss", "mae"]] for b in ends * EPOCHS]
    assert result["epochs"] == [0, 1]
    # verbose="auto" is 2 under ParameterServerStrategy (as in TensorFlow): one line per epoch.
    progress = [line for line in result["output"].splitlines() if line.startswith(f"{STEPS_PER_EPOCH}/{STEPS_PER_EPOCH} - ")]
    assert len(progress) == EPOCHS and all("loss: " in line and "val_mae: " in line for line in progress), progress
    assert sorted(result["evaluate"]) == ["loss", "mae"]
    assert result["evaluate"]["loss"] < history["loss"][0]


@pytest.mark.timeout(120)
def test_what_is_refused_says_what_to_do(result):
    errors = result["errors"]
    assert errors["tensors"].startswith("InvalidArgumentError: Under ParameterServerStrategy"), errors
    assert "DatasetCreator(dataset_fn)" in errors["tensors"]
    assert errors["evaluate_tensors"].startswith("InvalidArgumentError: Under ParameterServerStrategy")
    assert "needs steps_per_epoch=" in errors["no_steps"]
    assert errors["predict"].startswith("InvalidArgumentError: predict is not supported under ParameterServerStrategy")
    assert "load_model" in errors["predict"]
    assert errors["batch_size"].startswith("InvalidArgumentError: batch_size is not supported")
    assert errors["shuffle"].startswith("InvalidArgumentError: shuffle is not supported")
    assert "validation_data cannot be tuple" in errors["validation_tuple"]
    assert "needs validation_steps=" in errors["no_validation_steps"]


@pytest.mark.timeout(120)
def test_fit_and_evaluate_on_a_dataloader_and_a_dataset_read_on_the_workers(result):
    history = result["loader_history"]
    assert history["loss"][2] < history["loss"][1] < history["loss"][0]
    assert history["val_loss"][2] < history["val_loss"][0]
    assert result["loader_evaluate"]["loss"] < history["loss"][0]
    # 3 epochs x (2 train functions of 4 steps + 1 validation function) + evaluate's 1 + the schedule.
    assert result["loader_functions"] == 3 * (2 + 1) + 1 + 1
    assert result["first_batch"] == 16
    errors = result["errors"]
    assert "x cannot be a generator: an iterator is read where it was made" in errors["generator"], errors
    assert "create_per_worker_dataset cannot take a generator" in errors["per_worker_generator"], errors
    assert errors["loader_batch_size"].startswith("InvalidArgumentError: batch_size is not supported"), errors


@pytest.mark.timeout(120)
def test_fit_with_backup_and_restore_resumes_after_the_coordinator_restarts(result):
    """TensorFlow's parameter server tutorial as written: fit(..., callbacks=[BackupAndRestore(dir)]).
    The first coordinator stops when its third epoch begins; a new model and optimizer (what a
    restarted coordinator makes) restore the backup of the second epoch's end and finish."""
    backup = result["backup"]
    assert backup["first_begun"] == [0, 1] and backup["second_begun"] == [2, 3]
    assert backup["restored_equal"]  # parameters (on the servers) and momentum, as saved
    assert backup["files_after_crash"] and backup["files_at_end"] == []  # deleted once training ends
    assert all(len(values) == 4 for values in backup["history"].values())  # the restored history goes on
    assert "save_freq='epoch'" in backup["save_freq_error"], backup["save_freq_error"]


@pytest.mark.timeout(120)
def test_a_keras3_model_is_refused_by_name_when_made_in_the_scope(result):
    error = result["keras3_error"]
    if error == "keras is not installed":
        pytest.skip("needs keras (the test extra installs it)")
    # Refused when made (keras.Model.__init__), before any layer is built.
    assert error.startswith("KerasUnsupportedError: A Keras model (Sequential) in ParameterServerStrategy.scope()"), error
    assert "td.keras.Model" in error


def test_dataset_creator_checks_its_arguments():
    with pytest.raises(td.InvalidArgumentError, match="takes a function input_context -> dataset"):
        td.keras.utils.experimental.DatasetCreator([1, 2])
    with pytest.raises(td.InvalidArgumentError, match="input_options must be a td.InputOptions"):
        td.keras.utils.experimental.DatasetCreator(lambda ctx: [], input_options={"x": 1})
    with pytest.raises(td.InvalidArgumentError, match="input_options are not supported"):
        ps_loops.dataset_function(td.keras.utils.experimental.DatasetCreator(lambda ctx: [], td.InputOptions()), "x")
    with pytest.raises(td.InvalidArgumentError, match="x cannot be a generator: an iterator is read where it was made"):
        ps_loops.dataset_function((row for row in [1, 2]), "x")
    with pytest.raises(td.InvalidArgumentError, match="cannot be Tensor: pass a DataLoader"):
        ps_loops.dataset_function(torch.ones(2), "x")
    # Sent by value, read again from the start when it ends (tf.data's repeat()); a map-style
    # Dataset is batched by fit's batch_size (and shuffled unless shuffle=False).
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(3.0)), batch_size=2)
    repeated = ps_loops.dataset_function(loader, "x")
    assert [b[0].tolist() for b, _ in zip(repeated, range(4), strict=False)] == [[0.0, 1.0], [2.0]] * 2
    options = {"batch_size": 2, "shuffle": False, "sample_weight": None}
    batches = ps_loops.dataset_function(torch.utils.data.TensorDataset(torch.arange(3.0)), "x", options, shuffle_option="shuffle")
    assert options == {"sample_weight": None}
    assert [b[0].tolist() for b, _ in zip(batches, range(3), strict=False)] == [[0.0, 1.0], [2.0], [0.0, 1.0]]


def test_dataset_creator_outside_parameter_server_training():
    def dataset_fn(input_context):
        rows = input_context.get_per_replica_batch_size(8)
        while True:
            yield torch.ones(rows, 1), 2 * torch.ones(rows, 1)

    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = td.keras.Model(torch.nn.Linear(1, 1))
    model.compile("sgd", "mse")
    creator = td.keras.utils.experimental.DatasetCreator(dataset_fn)
    history = model.fit(creator, epochs=2, steps_per_epoch=3, verbose=0)
    assert len(history.history["loss"]) == 2
    assert isinstance(model.evaluate(creator, steps=2, verbose=0), float)
    with pytest.raises(td.InvalidArgumentError, match="pass steps_per_epoch="):
        model.fit(creator, epochs=1, verbose=0)
