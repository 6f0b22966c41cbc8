"""Habits from DDP and Keras, written as their users write them: each is either refused or
warned about with a message that says what to write instead, and the form it names trains
as one device does (2 CPU replicas against one device, same global batch)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import torch_distribute as td

pytestmark = pytest.mark.timeout(120)

GLOBAL_BATCH = 8


def two_replicas() -> td.MirroredStrategy:
    return td.MirroredStrategy(["cpu:0", "cpu:1"])


def examples(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def train(strategy, batches, global_batch_size=GLOBAL_BATCH, seed=0):
    """A custom loop over ``batches`` (a distributed dataset); the parameters after it."""
    torch.manual_seed(seed)
    with strategy.scope():
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def step(x, y):
        opt.zero_grad()
        per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = td.compute_average_loss(per_example, global_batch_size=global_batch_size)
        loss.backward()
        opt.step()
        return loss

    for x, y in batches:
        strategy.run(step, args=(x, y))
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# -- a DistributedSampler given to experimental_distribute_dataset --------------------------------


def test_a_ddp_loader_with_distributed_sampler_is_refused_and_the_named_forms_train_as_one_device():
    strategy = two_replicas()
    data = examples()
    # What a DDP user writes: each process (here: replica) samples its shard.
    sampler = DistributedSampler(data, num_replicas=strategy.num_replicas_in_sync, rank=0, shuffle=False)
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // 2, sampler=sampler)
    with pytest.raises(td.DatasetError) as info:
        strategy.experimental_distribute_dataset(loader)
    message = str(info.value)
    assert "DistributedSampler(num_replicas=2, rank=0)" in message and "sharded twice" in message
    assert "distribute_datasets_from_function" in message and "ctx.num_input_pipelines" in message
    assert "plain sampler" in message
    assert isinstance(info.value, td.DistributeError)
    # The batch_sampler form is caught too.
    batched = DataLoader(data, batch_sampler=torch.utils.data.BatchSampler(sampler, 4, drop_last=False))
    with pytest.raises(td.DatasetError, match="sharded twice"):
        strategy.experimental_distribute_dataset(batched)

    one_device = train(td.OneDeviceStrategy("cpu"), DataLoader(data, batch_size=GLOBAL_BATCH))
    # 1. A plain loader of global batches.
    plain = strategy.experimental_distribute_dataset(DataLoader(data, batch_size=GLOBAL_BATCH))
    torch.testing.assert_close(train(strategy, plain), one_device)

    # 2. The DistributedSampler kept, one loader per input pipeline (one per worker here),
    # each replica taking its own consecutive per-replica batches.
    def dataset_fn(ctx):
        shard = DistributedSampler(data, num_replicas=ctx.num_input_pipelines, rank=ctx.input_pipeline_id,
                                   shuffle=False)
        return DataLoader(data, batch_size=ctx.get_per_replica_batch_size(GLOBAL_BATCH), sampler=shard)

    torch.testing.assert_close(train(strategy, strategy.distribute_datasets_from_function(dataset_fn)), one_device)


def test_a_sampler_declared_as_this_workers_shard_with_auto_shard_policy_off_is_accepted():
    data = examples()
    strategy = td.OneDeviceStrategy("cpu")
    options = td.InputOptions(auto_shard_policy=td.AutoShardPolicy.OFF)
    # One worker: num_replicas=1 shards nothing; a sampler of 2 shards without OFF is refused.
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, num_replicas=1, rank=0))
    assert sum(len(y) for _, y in strategy.experimental_distribute_dataset(loader)) == len(data)
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    with pytest.raises(td.DatasetError, match="sharded twice"):
        strategy.experimental_distribute_dataset(loader, options)


# -- a Keras string loss on a torch model's logits --------------------------------------------------


def keras_model(strategy):
    torch.manual_seed(0)
    with strategy.scope():
        return td.keras.Model(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)))


@pytest.mark.parametrize("loss", ["sparse_categorical_crossentropy", td.keras.losses.SparseCategoricalCrossentropy(),
                                  "categorical_crossentropy", "binary_crossentropy"])
def test_a_keras_string_loss_on_logits_warns_once_naming_from_logits(loss):
    x, labels = examples().tensors
    y = labels
    if loss == "categorical_crossentropy":
        y = torch.nn.functional.one_hot(labels, 3).float()
    if loss == "binary_crossentropy":
        y = torch.nn.functional.one_hot(labels, 3).float()  # three independent labels
    model = keras_model(two_replicas())
    model.compile(optimizer="sgd", loss=loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0)
    about_logits = [w for w in caught if "from_logits=True" in str(w.message)]
    assert len(about_logits) == 1, [str(w.message) for w in caught]
    message = str(about_logits[0].message)
    assert "look like logits" in message and "outside [0, 1]" in message
    name = {"sparse_categorical_crossentropy": "SparseCategoricalCrossentropy",
            "categorical_crossentropy": "CategoricalCrossentropy",
            "binary_crossentropy": "BinaryCrossentropy"}.get(loss, "SparseCategoricalCrossentropy")
    assert f"td.keras.losses.{name}(from_logits=True)" in message


def test_probabilities_and_from_logits_true_train_without_a_warning_and_as_one_device():
    x, y = examples().tensors
    weights = []
    for strategy in (td.OneDeviceStrategy("cpu"), two_replicas()):
        model = keras_model(strategy)
        model.compile(optimizer="sgd", loss=td.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning at all
            model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0)
        weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(weights[1], weights[0])
    # A softmax output (probabilities, summing to 1) with the string loss: no warning either.
    torch.manual_seed(0)
    softmax = td.keras.Model(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Softmax(-1)))
    softmax.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        softmax.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
    # Probabilities that do not sum to 1 (a sigmoid per class) with a categorical loss: warned.
    loss = td.keras.losses.CategoricalCrossentropy()
    with pytest.warns(UserWarning, match="do not sum to 1 along the class axis"):
        loss(torch.eye(3)[:2], torch.sigmoid(torch.randn(2, 3)))


def test_the_probability_check_reads_only_the_first_batches():
    """Only the first calls look at the values (each reads them back to the host: a device
    synchronisation); later calls add no operation at all."""
    from torch.overrides import TorchFunctionMode

    class CountMinMax(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.aminmax:
                CountMinMax.calls += 1
            return func(*args, **(kwargs or {}))

    loss = td.keras.losses.SparseCategoricalCrossentropy()
    probs, labels = torch.softmax(torch.randn(16, 10), -1), torch.randint(0, 10, (16,))
    with CountMinMax():
        loss(labels[:0], probs[:0])  # an empty replica's batch is not counted
        for _ in range(10):
            loss(labels, probs)
    assert CountMinMax.calls == 3


# -- compute_average_loss without global_batch_size on a ragged last batch -------------------------


def test_compute_average_loss_without_global_batch_size_is_exact_on_an_even_ragged_batch():
    # 28 examples: 3 global batches of 8 and a ragged one of 4, which 2 replicas split 2 and 2.
    # The guess rows x replicas is then this step's global batch: exact, so no warning, and the
    # result is one device's mean at every step (the minGPT port's case).
    data = examples(28)
    strategy = two_replicas()

    def guessing(strategy, batches):
        torch.manual_seed(0)
        with strategy.scope():
            model = torch.nn.Linear(4, 3)
            opt = torch.optim.SGD(model.parameters(), lr=0.5)

        def step(x, y):
            opt.zero_grad()
            td.compute_average_loss(torch.nn.functional.cross_entropy(model(x), y, reduction="none")).backward()
            opt.step()

        for x, y in batches:
            strategy.run(step, args=(x, y))
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        two = guessing(strategy, strategy.experimental_distribute_dataset(DataLoader(data, batch_size=GLOBAL_BATCH)))
    one_device = guessing(td.OneDeviceStrategy("cpu"), DataLoader(data, batch_size=GLOBAL_BATCH))
    torch.testing.assert_close(two, one_device)


def test_compute_average_loss_without_global_batch_size_warns_when_its_guess_is_inexact():
    data = examples(28)  # 3 global batches of 8 and a ragged one of 4
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])  # 8 rows split 3, 3, 2

    with strategy.scope():
        model = torch.nn.Linear(4, 3)

    def step(x, y):
        per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        return td.compute_average_loss(per_example)  # the habit: no global_batch_size

    batches = strategy.experimental_distribute_dataset(DataLoader(data, batch_size=GLOBAL_BATCH))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # two epochs: still one warning
            for x, y in batches:
                strategy.run(step, args=(x, y))
    inexact = [w for w in caught if "global_batch_size" in str(w.message)]
    assert len(inexact) == 1, [str(w.message) for w in caught]
    message = str(inexact[0].message)
    # Whichever replica warns first (they run concurrently): 3 rows (3 x 3 = 9) or 2 (2 x 3 = 6).
    assert ("got 3 rows" in message and "3 × 3 = 9" in message) or ("got 2 rows" in message and "2 × 3 = 6" in message)
    assert "has 8 rows" in message
    assert inexact[0].filename == __file__  # points at the user's line

    # The named fix trains as one device does, ragged batch included.
    one_device = train(td.OneDeviceStrategy("cpu"), DataLoader(data, batch_size=GLOBAL_BATCH))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        two = train(strategy, strategy.experimental_distribute_dataset(DataLoader(data, batch_size=GLOBAL_BATCH)))
    torch.testing.assert_close(two, one_device)
