"""TensorFlow's guide "Distributed training with TensorFlow" (tensorflow/docs,
``site/en/guide/distributed_training.ipynb``), ported cell by cell.

Every code cell that needs no GPU or TPU, with mechanical changes only: ``tf.distribute.X`` ->
``td.X``, ``tf.config`` -> ``td.config``, ``tf.function`` -> ``td.function``, a
``tf.data.Dataset.from_tensors(...).repeat(n).batch(g)`` -> the list of its batches,
``tf.keras.Sequential([Dense(1)])`` -> ``td.keras.Model(torch.nn.Sequential(torch.nn.Linear(1, 1)))``,
``GradientTape``/``apply_gradients`` -> ``backward()``/``step()``. The guide prints no outputs;
the expected values are what TensorFlow 2.21 (CPU, Keras 3.15) printed for the same cells with
the CPU split into 2 logical devices (as the "Distributed input" guide does to simulate
replicas), the Dense kernel set to 0.5 in both (Keras draws it at random). The multi-worker
cells 16 and 18 also run on 2 workers in ``test_tf_guides_multi_worker.py``.

Two cells need more than a mechanical change (``docs/porting.md`` lists them):
``kernel_regularizer=tf.keras.regularizers.L2(1e-4)`` has no counterpart: in ``fit`` the
kernel's weight decay of ``2e-4`` in SGD makes the same updates (the reported loss then leaves
out the penalty, ``1e-4 * w**2`` or about 4e-5 here), and in the custom loop ``model.losses`` is
written out as that penalty.

``td.function`` runs eagerly here (``eager_functions``: ``td.config.run_functions_eagerly``,
TensorFlow's ``tf.config.run_functions_eagerly``): what is tested is the guide's cells and
their numbers; compiling them (minutes of C++ compilation on a cold cache) is
``test_compile.py``'s.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import torch_distribute as td

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def two_logical_cpus():
    cpu = td.config.list_physical_devices("CPU")[0]
    td.config.set_logical_device_configuration(cpu, [td.config.LogicalDeviceConfiguration()] * 2)
    yield
    td.config.set_logical_device_configuration(cpu, None)


def dense_1x1() -> torch.nn.Linear:
    """``tf.keras.layers.Dense(1, input_shape=(1,))``, its kernel set to 0.5 (zero bias, as Keras)."""
    layer = torch.nn.Linear(1, 1)
    with torch.no_grad():
        layer.weight.fill_(0.5)
        layer.bias.zero_()
    return layer


def ones_batches(count: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``tf.data.Dataset.from_tensors(([1.], [1.])).repeat(count).batch(batch)``."""
    return [(torch.ones(min(batch, count - start), 1), torch.ones(min(batch, count - start), 1))
            for start in range(0, count, batch)]


# -- Types of strategies ----------------------------------------------------------------------


def test_cell_09_mirrored_strategy_uses_the_logical_cpus(two_logical_cpus):
    # TensorFlow 2.21: 2 replicas, CPU:0 and CPU:1 (1 replica on CPU:0 without the split).
    mirrored_strategy = td.MirroredStrategy()
    assert mirrored_strategy.num_replicas_in_sync == 2
    assert [str(d) for d in mirrored_strategy.extended.worker_devices] == ["cpu:0", "cpu:1"]


def test_cell_09_without_logical_devices_one_replica_on_the_cpu():
    assert td.MirroredStrategy().num_replicas_in_sync == 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the cell names two GPUs")
def test_cell_11_mirrored_strategy_on_two_gpus():
    mirrored_strategy = td.MirroredStrategy(devices=["/gpu:0", "/gpu:1"])
    assert mirrored_strategy.num_replicas_in_sync == 2


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="only without two GPUs")
def test_cell_11_without_the_gpus_is_a_clear_error():
    # TensorFlow 2.21 makes the strategy on the GPU names although none exists (its ops fall back
    # to the CPU); this library refuses devices it does not have (docs/porting.md).
    with pytest.raises(td.InvalidDeviceError, match="set_logical_device_configuration"):
        td.MirroredStrategy(devices=["/gpu:0", "/gpu:1"])


def test_cell_13_hierarchical_copy_all_reduce(two_logical_cpus):
    mirrored_strategy = td.MirroredStrategy(cross_device_ops=td.HierarchicalCopyAllReduce())
    assert mirrored_strategy.num_replicas_in_sync == 2  # TensorFlow 2.21: 2
    ids = mirrored_strategy.run(lambda: torch.tensor(td.get_replica_context().replica_id_in_sync_group + 1.0))
    assert float(mirrored_strategy.reduce(td.ReduceOp.SUM, ids, axis=None)) == 3.0


def test_cell_16_multi_worker_mirrored_strategy_in_one_process(two_logical_cpus):
    # TensorFlow 2.21 without TF_CONFIG: one worker, 1 replica on CPU:0 (logical CPUs or not).
    strategy = td.MultiWorkerMirroredStrategy()
    assert strategy.num_replicas_in_sync == 1
    assert [str(d) for d in strategy.extended.worker_devices] == ["cpu:0"]


def test_cell_18_nccl_without_gpus_is_refused():
    # TensorFlow 2.21 logs "Enabled NCCL communication but no GPUs detected/specified." and
    # runs; this library refuses NCCL on CPU devices (docs/porting.md).
    communication_options = td.experimental.CommunicationOptions(
        implementation=td.experimental.CommunicationImplementation.NCCL)
    with pytest.raises(td.InvalidArgumentError, match="NCCL needs CUDA devices"):
        td.MultiWorkerMirroredStrategy(communication_options=communication_options)


def test_cell_23_central_storage_strategy(two_logical_cpus):
    # TensorFlow 2.21: 1 replica on CPU:0, variables on CPU:0 (its compute devices are the GPUs,
    # else the CPU; logical CPUs are not used).
    central_storage_strategy = td.experimental.CentralStorageStrategy()
    assert central_storage_strategy.num_replicas_in_sync == 1
    assert [str(d) for d in central_storage_strategy.extended.worker_devices] == ["cpu:0"]
    assert [str(d) for d in central_storage_strategy.extended.parameter_devices] == ["cpu:0"]


def test_cells_28_and_30_the_default_strategy_reduces_a_value_as_is():
    default_strategy = td.get_strategy()
    # In optimizer or other library code: get the currently active strategy.
    strategy = td.get_strategy()
    reduced = strategy.reduce("SUM", 1.0, axis=None)
    assert strategy is default_strategy
    # TensorFlow 2.21: the Python float 1.0; here a 0-d float64 tensor of 1.0 (docs/porting.md).
    assert isinstance(reduced, torch.Tensor) and reduced.dim() == 0 and float(reduced) == 1.0


def test_cell_32_the_default_strategy_runs_the_code_as_written():
    if td.config.list_physical_devices("GPU"):
        strategy = td.MirroredStrategy()
    else:  # Use the Default Strategy
        strategy = td.get_strategy()
    with strategy.scope():
        # tf.Variable(1.): TensorFlow 2.21 prints <tf.Variable shape=() dtype=float32, numpy=1.0>.
        variable = torch.nn.Parameter(torch.tensor(1.0))
        assert variable.shape == () and variable.dtype == torch.float32 and variable.item() == 1.0
        # TensorFlow 2.21 in the default strategy's scope: a replica context, as outside any scope
        # (in a MirroredStrategy's scope: cross-replica context).
        assert td.in_cross_replica_context() is not strategy.is_default
        assert (td.get_replica_context() is not None) is strategy.is_default


# -- Keras Model.fit ---------------------------------------------------------------------------

# TensorFlow 2.21 for cells 36-40 (kernel 0.5, bias 0; the losses include the L2 penalty).
TF_FIT_38 = {"loss": [0.17796552181243896, 0.07869099080562592], "evaluate": 0.04888967052102089,
             "kernel": 0.6394796371459961, "bias": 0.13950276374816895}
TF_FIT_40 = {"loss": [0.03481225669384003, 0.015418153256177902],
             "kernel": 0.7011204361915588, "bias": 0.20117038488388062}
PENALTY = 1e-4  # the L2 penalty left out of the reported losses: 1e-4 * kernel**2 < 1e-4


def test_cells_36_to_43_keras_fit_as_tensorflow(two_logical_cpus):
    mirrored_strategy = td.MirroredStrategy()
    with mirrored_strategy.scope():
        model = td.keras.Model(torch.nn.Sequential(dense_1x1()))
        kernel, bias = model.module[0].weight, model.module[0].bias
        # kernel_regularizer=L2(1e-4) with optimizer='sgd' (learning rate 0.01): the same update.
        sgd = torch.optim.SGD([{"params": [kernel], "weight_decay": 2e-4}, {"params": [bias]}], lr=0.01)
    model.compile(loss="mse", optimizer=sgd)

    # Cell 38.
    dataset = ones_batches(100, 10)
    history = model.fit(dataset, epochs=2, verbose=0)
    evaluated = model.evaluate(dataset, verbose=0)
    assert history.history["loss"] == pytest.approx(TF_FIT_38["loss"], abs=PENALTY)
    assert evaluated == pytest.approx(TF_FIT_38["evaluate"], abs=PENALTY)
    assert kernel.item() == pytest.approx(TF_FIT_38["kernel"], rel=1e-6)
    assert bias.item() == pytest.approx(TF_FIT_38["bias"], rel=1e-6)

    # Cell 40.
    inputs, targets = np.ones((100, 1)), np.ones((100, 1))
    history = model.fit(inputs, targets, epochs=2, batch_size=10, verbose=0)
    assert history.history["loss"] == pytest.approx(TF_FIT_40["loss"], abs=PENALTY)
    assert kernel.item() == pytest.approx(TF_FIT_40["kernel"], rel=1e-6)
    assert bias.item() == pytest.approx(TF_FIT_40["bias"], rel=1e-6)

    # Cell 42.
    assert mirrored_strategy.num_replicas_in_sync == 2

    # Cell 43.
    BATCH_SIZE_PER_REPLICA = 5
    global_batch_size = BATCH_SIZE_PER_REPLICA * mirrored_strategy.num_replicas_in_sync
    dataset = ones_batches(100, global_batch_size)
    LEARNING_RATES_BY_BATCH_SIZE = {5: 0.1, 10: 0.15, 20: 0.175}
    learning_rate = LEARNING_RATES_BY_BATCH_SIZE[global_batch_size]
    assert (global_batch_size, learning_rate, len(dataset)) == (10, 0.15, 10)  # TensorFlow 2.21


# -- Custom training loops ---------------------------------------------------------------------

# TensorFlow 2.21, cells 54 (100 steps, some of them) and 56 (10 more), kernel 0.5 at first.
TF_LOSSES_54 = {0: 0.4741019904613495, 1: 0.4712586998939514, 2: 0.46844202280044556, 49: 0.36125630140304565,
                50: 0.3594227731227875, 97: 0.28813403844833374, 98: 0.28688424825668335, 99: 0.2856438159942627}
TF_AFTER_54 = (0.8059422969818115, 0.3060746192932129)
TF_LOSSES_56 = [0.284412682056427, 0.28319066762924194, 0.28197774291038513, 0.280773788690567,
                0.2795787751674652, 0.278392493724823, 0.27721497416496277, 0.2760460674762726,
                0.27488571405410767, 0.27373388409614563]
TF_AFTER_56 = (0.8302680253982544, 0.330416738986969)


def test_cells_47_to_56_custom_training_loop_as_tensorflow(two_logical_cpus, eager_functions):
    mirrored_strategy = td.MirroredStrategy()
    global_batch_size = 5 * mirrored_strategy.num_replicas_in_sync  # cell 43

    # Cell 47.
    with mirrored_strategy.scope():
        model = torch.nn.Sequential(dense_1x1())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)  # tf.keras.optimizers.SGD()

    # Cell 49.
    dataset = ones_batches(1000, global_batch_size)
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)

    # Cell 51.
    loss_object = td.keras.losses.BinaryCrossentropy(from_logits=True, reduction="none")

    def train_step(inputs):
        features, labels = inputs
        predictions = model(features)
        per_example_loss = loss_object(labels, predictions)
        loss = td.compute_average_loss(per_example_loss)
        model_losses = [1e-4 * model[0].weight.square().sum()]  # model.losses: the L2 penalty
        if model_losses:
            loss += td.scale_regularization_loss(torch.stack(model_losses).sum())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    @td.function
    def distributed_train_step(dist_inputs):
        per_replica_losses = mirrored_strategy.run(train_step, args=(dist_inputs,))
        return mirrored_strategy.reduce(td.ReduceOp.SUM, per_replica_losses, axis=None)

    # Cell 54.
    losses = [distributed_train_step(dist_inputs) for dist_inputs in dist_dataset]
    assert len(losses) == 100
    assert all(loss.shape == () and loss.dtype == torch.float32 for loss in losses)
    assert {i: float(losses[i]) for i in TF_LOSSES_54} == pytest.approx(TF_LOSSES_54, rel=1e-6)
    assert (model[0].weight.item(), model[0].bias.item()) == pytest.approx(TF_AFTER_54, rel=1e-6)

    # Cell 56.
    iterator = iter(dist_dataset)
    losses = [float(distributed_train_step(next(iterator))) for _ in range(10)]
    assert losses == pytest.approx(TF_LOSSES_56, rel=1e-6)
    assert (model[0].weight.item(), model[0].bias.item()) == pytest.approx(TF_AFTER_56, rel=1e-6)


# -- Setting up the TF_CONFIG environment variable -------------------------------------------------


def test_cell_60_the_tf_config_example(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {
            "worker": ["host1:port", "host2:port", "host3:port"],
            "ps": ["host4:port", "host5:port"],
        },
        "task": {"type": "worker", "index": 1},
    }))
    resolver = td.cluster_resolver.TFConfigClusterResolver()
    # TensorFlow 2.21: worker 1 {'worker': [...], 'ps': [...]} host2:port
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert resolver.cluster_spec().as_dict() == {"worker": ["host1:port", "host2:port", "host3:port"],
                                                 "ps": ["host4:port", "host5:port"]}
    assert resolver.master() == "host2:port"
