"""TensorFlow's tutorial "Distributed Input" (tensorflow/docs,
``site/en/tutorials/distribute/input.ipynb``), ported cell by cell.

Every code cell that needs no GPU or TPU, with mechanical changes only: ``tf.distribute.X`` ->
``td.X``, ``tf.config`` -> ``td.config``, ``tf.function`` -> ``td.function``, ``tf.data``
pipelines -> the lists (or generators) of their elements (``batch``, ``shard`` below are
``Dataset.batch`` and ``Dataset.shard`` on a list), ``tf.constant`` -> ``torch.tensor``,
``tf.print`` -> ``print``. The guide prints no outputs; the expected values are what
TensorFlow 2.21 (CPU) printed for the same cells, with the guide's 2 logical CPU devices, and
what the guide's text documents (the batching examples). The sharding cells (2 workers) are in
``test_tf_guides_multi_worker.py``.

Cell 51 needs more than a mechanical change (``docs/porting.md``): torch has no string tensors,
so the Keras ``StringLookup`` layer is a lookup of the strings (``StringLookup`` below) and the
dataset of strings a generator.

Small differences kept, each asserted where it shows: ``element_spec`` describes one replica's
batch (``td.TensorSpec``, TensorFlow: a ``PerReplicaSpec`` of them); the empty batch a replica
gets when a dataset function's worker has no more elements keeps the batch's other dimensions
(``(0, 16, 1)``; TensorFlow: ``(0, 0, 1)``, its unknown dimensions as 0); logical devices are
named ``cpu:0`` (TensorFlow: ``/device:CPU:0``).

``td.function`` runs eagerly here (``eager_functions``: ``td.config.run_functions_eagerly``,
TensorFlow's ``tf.config.run_functions_eagerly``; compiling is ``test_compile.py``'s).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import torch_distribute as td

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def logical_cpus():
    """Cell 8: ``N_VIRTUAL_DEVICES = 2`` logical CPU devices, for every cell."""
    N_VIRTUAL_DEVICES = 2
    physical_devices = td.config.list_physical_devices("CPU")
    td.config.set_logical_device_configuration(
        physical_devices[0], [td.config.LogicalDeviceConfiguration() for _ in range(N_VIRTUAL_DEVICES)])
    yield
    td.config.set_logical_device_configuration(physical_devices[0], None)


def batch(elements: list, batch_size: int) -> list:
    """``Dataset.batch(batch_size)`` of a list of elements (tensors or tuples of them)."""
    groups = [elements[start:start + batch_size] for start in range(0, len(elements), batch_size)]
    return [tuple(torch.stack(column) for column in zip(*group, strict=True)) if isinstance(group[0], tuple)
            else torch.stack(group) for group in groups]


def shard(elements: list, num_shards: int, index: int) -> list:
    """``Dataset.shard(num_shards, index)`` of a list."""
    return elements[index::num_shards]


def ones(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``tf.data.Dataset.from_tensors(([1.], [1.])).repeat(count)``."""
    return [(torch.tensor([1.0]), torch.tensor([1.0]))] * count


def local(strategy: td.Strategy, value) -> list:
    return [t.tolist() for t in strategy.experimental_local_results(value)]


# -- Distributed datasets -----------------------------------------------------------------------


def test_cell_9_the_logical_devices():
    devices = td.config.list_logical_devices()
    # TensorFlow 2.21: 0) /device:CPU:0, 1) /device:CPU:1
    assert [(d.name, d.device_type) for d in devices] == [("cpu:0", "CPU"), ("cpu:1", "CPU")]


def test_cell_10_a_non_distributed_loop(eager_functions):
    global_batch_size = 16
    dataset = batch(ones(100), global_batch_size)

    @td.function
    def train_step(inputs):
        features, labels = inputs
        return labels - 0.3 * features

    outputs = [train_step(inputs) for inputs in dataset]
    # TensorFlow 2.21: 6 tensors of shape (16, 1), then (4, 1), every value 0.7.
    assert [tuple(o.shape) for o in outputs] == [(16, 1)] * 6 + [(4, 1)]
    assert all(torch.all(o == torch.tensor(1.0) - 0.3 * torch.tensor(1.0)) for o in outputs)


def test_cell_14_experimental_distribute_dataset():
    global_batch_size = 16
    mirrored_strategy = td.MirroredStrategy()
    dataset = batch(ones(100), global_batch_size)
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
    first = next(iter(dist_dataset))
    # TensorFlow 2.21: a tuple of 2 PerReplica, each of 2 tensors of shape (8, 1) (CPU:0, CPU:1).
    assert isinstance(first, tuple) and len(first) == 2
    for part in first:
        assert isinstance(part, td.PerReplica)
        assert [tuple(t.shape) for t in part.values] == [(8, 1), (8, 1)]
        assert all(torch.all(t == 1.0) for t in part.values)


@pytest.mark.parametrize(("replicas", "rows", "global_batch", "expected"), [
    # The guide's text, and TensorFlow 2.21 the same.
    (2, 6, 4, [[[0, 1], [2, 3]], [[4], [5]]]),
    (5, 4, 4, [[[0], [1], [2], [3], []]]),
    (3, 8, 4, [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []]]),
])
def test_cell_16_batching_examples(replicas, rows, global_batch, expected):
    strategy = td.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    dataset = DataLoader(torch.arange(rows), batch_size=global_batch)  # Dataset.range(rows).batch(4)
    assert [local(strategy, x) for x in strategy.experimental_distribute_dataset(dataset)] == expected


def test_cell_18_a_shard_policy_in_the_dataset_options():
    mirrored_strategy = td.MirroredStrategy()
    dataset = batch(ones(64), 16)
    options = td.data.Options()
    options.experimental_distribute.auto_shard_policy = td.data.experimental.AutoShardPolicy.DATA
    dataset = td.data.with_options(dataset, options)
    steps = [[tuple(t.shape) for t in features.values]
             for features, _ in mirrored_strategy.experimental_distribute_dataset(dataset)]
    assert steps == [[(8, 1), (8, 1)]] * 4  # TensorFlow 2.21: one worker, nothing to shard


def test_cell_23_distribute_datasets_from_function():
    global_batch_size = 16  # from cell 14
    mirrored_strategy = td.MirroredStrategy()
    contexts = []

    def dataset_fn(input_context):
        contexts.append((input_context.num_input_pipelines, input_context.input_pipeline_id,
                         input_context.num_replicas_in_sync))
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        dataset = batch(ones(64), 16)
        dataset = shard(dataset, input_context.num_input_pipelines, input_context.input_pipeline_id)
        dataset = batch(dataset, batch_size)
        return dataset  # .prefetch(2): the distributed dataset reads ahead itself

    dist_dataset = mirrored_strategy.distribute_datasets_from_function(dataset_fn)
    steps = [[tuple(t.shape) for t in features.values] for features, _ in dist_dataset]
    assert contexts == [(1, 0, 2)]  # TensorFlow 2.21: one input pipeline for 2 replicas
    # TensorFlow 2.21: one step, replica 0 gets the one element (4, 16, 1), replica 1 an empty
    # batch, which TensorFlow shapes (0, 0, 1) (unknown dimensions as 0) and this library
    # (0, 16, 1).
    assert steps == [[(4, 16, 1), (0, 16, 1)]]


# -- Distributed iterators ----------------------------------------------------------------------


def test_cells_33_and_35_iterating_with_for_and_with_next(eager_functions):
    global_batch_size = 16
    mirrored_strategy = td.MirroredStrategy()
    dataset = batch(ones(100), global_batch_size)
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)

    @td.function
    def train_step(inputs):
        features, labels = inputs
        return labels - 0.3 * features

    losses = [mirrored_strategy.run(train_step, args=(x,)) for x in dist_dataset]
    # TensorFlow 2.21: 7 PerReplica, (8, 1) on each replica, then (2, 1), every value 0.7.
    assert all(isinstance(loss, td.PerReplica) for loss in losses)
    assert [[tuple(t.shape) for t in loss.values] for loss in losses] == [[(8, 1), (8, 1)]] * 6 + [[(2, 1), (2, 1)]]
    assert all(torch.allclose(t, torch.tensor(0.7)) for loss in losses for t in loss.values)

    # Cell 35.
    num_epochs = 10
    steps_per_epoch = 5
    shapes = []
    for _ in range(num_epochs):
        dist_iterator = iter(dist_dataset)
        for _ in range(steps_per_epoch):
            loss = mirrored_strategy.run(train_step, args=(next(dist_iterator),))
            shapes.append([tuple(t.shape) for t in loss.values])
    assert shapes == [[(8, 1), (8, 1)]] * 50


def test_cell_36_get_next_past_the_end_raises_out_of_range():
    mirrored_strategy = td.MirroredStrategy()
    dist_iterator = iter(mirrored_strategy.experimental_distribute_dataset(DataLoader(torch.arange(4), batch_size=4)))
    dist_iterator.get_next()
    with pytest.raises(td.OutOfRangeError):  # TensorFlow 2.21: tf.errors.OutOfRangeError
        dist_iterator.get_next()


def test_cell_37_get_next_as_optional_in_a_function(eager_functions, capsys):
    global_batch_size = 4
    steps_per_loop = 5
    strategy = td.MirroredStrategy()
    dataset = DataLoader(torch.arange(9), batch_size=global_batch_size)
    distributed_iterator = iter(strategy.experimental_distribute_dataset(dataset))

    @td.function
    def train_fn(distributed_iterator):
        for _ in range(steps_per_loop):
            optional_data = distributed_iterator.get_next_as_optional()
            if not optional_data.has_value():
                break
            per_replica_results = strategy.run(lambda x: x, args=(optional_data.get_value(),))
            print(local(strategy, per_replica_results))  # tf.print

    train_fn(distributed_iterator)
    # TensorFlow 2.21: ([0 1], [2 3]) / ([4 5], [6 7]) / ([8], [])
    assert capsys.readouterr().out.splitlines() == ["[[0, 1], [2, 3]]", "[[4, 5], [6, 7]]", "[[8], []]"]


# -- Using the element_spec property ----------------------------------------------------------


def test_cell_40_element_spec_as_input_signature(eager_functions):
    global_batch_size = 16
    epochs = 5
    steps_per_epoch = 5
    mirrored_strategy = td.MirroredStrategy()
    dataset = batch(ones(100), global_batch_size)
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)

    @td.function(input_signature=[dist_dataset.element_spec])
    def train_step(per_replica_inputs):
        def step_fn(inputs):
            return 2 * inputs

        return mirrored_strategy.run(step_fn, args=(per_replica_inputs,))

    outputs = []
    for _ in range(epochs):
        iterator = iter(dist_dataset)
        for _ in range(steps_per_epoch):
            outputs.append(train_step(next(iterator)))
    # TensorFlow 2.21: 25 outputs; `2 * inputs` repeats the (features, labels) tuple, so each is
    # a tuple of 4 PerReplica, each of 2 tensors of ones of shape (8, 1).
    assert dist_dataset.element_spec == (td.TensorSpec((None, 1), torch.float32),) * 2
    assert len(outputs) == 25
    for output in outputs:
        assert isinstance(output, tuple) and len(output) == 4
        assert all(isinstance(part, td.PerReplica) for part in output)
        assert all(t.shape == (8, 1) and torch.all(t == 1.0) for part in output for t in part.values)


# -- Data preprocessing ------------------------------------------------------------------------


class StringLookup:
    """``tf.keras.layers.StringLookup(vocabulary=vocab)``: index 0 for a string not in it."""

    def __init__(self, vocabulary: list[str]):
        self.index = {token: i + 1 for i, token in enumerate(vocabulary)}

    def __call__(self, tokens: list[str]) -> torch.Tensor:
        return torch.tensor([self.index.get(token, 0) for token in tokens])


def test_cell_51_preprocessing_in_a_dataset_function():
    strategy = td.MirroredStrategy()
    vocab = ["a", "b", "c", "d", "f"]

    with strategy.scope():
        # Create the layer(s) under scope.
        layer = StringLookup(vocabulary=vocab)

    def dataset_fn(input_context):
        # a tf.data.Dataset
        strings = itertools.cycle(["a", "c", "e"])  # from_tensor_slices(["a", "c", "e"]).repeat()

        # Custom your batching, sharding, prefetching, etc.
        global_batch_size = 4
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        dataset = iter(lambda: [next(strings) for _ in range(batch_size)], None)  # .batch(batch_size)
        dataset = itertools.islice(dataset, input_context.input_pipeline_id, None,
                                   input_context.num_input_pipelines)  # .shard(...)

        # Apply the preprocessing layer(s) to the dataset.
        def preprocess_with_kpl(input):
            return layer(input)

        processed_ds = map(preprocess_with_kpl, dataset)
        return processed_ds

    distributed_dataset = strategy.distribute_datasets_from_function(dataset_fn)
    distributed_dataset_iterator = iter(distributed_dataset)
    printed = [next(distributed_dataset_iterator) for _ in range(3)]
    # TensorFlow 2.21: PerReplica {0: [1 3], 1: [0 1]}, {0: [3 0], 1: [1 3]}, {0: [0 1], 1: [3 0]}, int64.
    assert all(isinstance(x, td.PerReplica) and x.values[0].dtype == torch.int64 for x in printed)
    assert [local(strategy, x) for x in printed] == [[[1, 3], [0, 1]], [[3, 0], [1, 3]], [[0, 1], [3, 0]]]


# -- Caveats: ordering the outputs ------------------------------------------------------------


def test_cell_60_reordering_predictions_by_index():
    mirrored_strategy = td.MirroredStrategy()
    dataset_size = 24
    batch_size = 6
    elements = [(torch.tensor(i), x) for i, x in enumerate(torch.arange(dataset_size))]  # range(24).enumerate()
    dataset = batch(elements, batch_size)
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)

    def predict(index, inputs):
        outputs = 2 * inputs
        return index, outputs

    result = {}
    for index, inputs in dist_dataset:
        output_index, outputs = mirrored_strategy.run(predict, args=(index, inputs))
        indices = list(mirrored_strategy.experimental_local_results(output_index))
        rindices = []
        for a in indices:
            rindices.extend(a.numpy())
        outputs = list(mirrored_strategy.experimental_local_results(outputs))
        routputs = []
        for a in outputs:
            routputs.extend(a.numpy())
        for i, value in zip(rindices, routputs, strict=True):
            result[i] = value

    assert result == {i: 2 * i for i in range(24)}  # TensorFlow 2.21: {0: 0, 1: 2, ..., 23: 46}


# -- Tensor inputs instead of tf.data -------------------------------------------------------------


def test_cell_63_distribute_values_from_function():
    mirrored_strategy = td.MirroredStrategy()

    def value_fn(ctx):
        return torch.tensor(ctx.replica_id_in_sync_group)  # tf.constant: int32 there, int64 here

    distributed_values = mirrored_strategy.experimental_distribute_values_from_function(value_fn)
    for _ in range(4):
        result = mirrored_strategy.run(lambda x: x, args=(distributed_values,))
        assert isinstance(result, td.PerReplica)  # TensorFlow 2.21: PerReplica {0: 0, 1: 1}
        assert local(mirrored_strategy, result) == [0, 1]


def test_cell_66_a_generator():
    mirrored_strategy = td.MirroredStrategy()

    def input_gen():
        while True:
            yield np.random.rand(4)

    # from_generator(input_gen, output_types=(tf.float32), output_shapes=tf.TensorShape([4]))
    dataset = (torch.as_tensor(x, dtype=torch.float32) for x in input_gen())
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
    iterator = iter(dist_dataset)
    for _ in range(4):
        result = mirrored_strategy.run(lambda x: x, args=(next(iterator),))
        # TensorFlow 2.21: PerReplica of 2 float32 tensors of shape (2,): each element of 4 rows
        # is a global batch.
        assert isinstance(result, td.PerReplica)
        assert [(tuple(t.shape), t.dtype) for t in result.values] == [((2,), torch.float32)] * 2
