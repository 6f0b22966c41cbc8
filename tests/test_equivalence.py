"""The headline property: N replicas with global batch G train exactly like one device with G.

Every test trains the same model from the same initial values twice: once with the
strategy (``strategy.run`` over a distributed dataset, loss scaled by the real global batch
size) and once with a plain hand-written PyTorch loop, and compares the parameters.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torch_distribute as td

pytestmark = pytest.mark.timeout(60)

TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """Tiny models: one intra-op thread each is fastest and avoids oversubscribing 2 cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def make_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(4 * 4 * 4, 4),
    )


MODELS = {"mlp": (make_mlp, (6,)), "cnn": (make_cnn, (1, 8, 8))}


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    raise AssertionError(name)


def make_loader(model_name: str, num_examples: int, global_batch: int, seed: int = 0) -> DataLoader:
    gen = torch.Generator().manual_seed(seed)
    shape = MODELS[model_name][1]
    x = torch.randn(num_examples, *shape, generator=gen)
    y = torch.randint(0, 4, (num_examples,), generator=gen)
    return DataLoader(TensorDataset(x, y), batch_size=global_batch, shuffle=False)


def initial_state(model_name: str, seed: int = 1) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in MODELS[model_name][0]().state_dict().items()}


def train_plain(model_name, optim_name, loader, epochs, state, exact_formula=False):
    """The hand-written loop on one device with the whole global batch."""
    model = MODELS[model_name][0]()
    model.load_state_dict(state)
    opt = make_optimizer(optim_name, model.parameters())
    for _ in range(epochs):
        for x, y in loader:
            if exact_formula:
                loss = F.cross_entropy(model(x), y, reduction="none").sum() / x.shape[0]
            else:
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return model


def train_strategy(strategy, model_name, optim_name, loader, epochs, state, check_copies=True):
    with strategy.scope():
        model = MODELS[model_name][0]()
        opt = make_optimizer(optim_name, model.parameters())
    model.load_state_dict(state)

    def step(x, y, global_batch_size):
        per_example = F.cross_entropy(model(x), y, reduction="none")
        loss = td.compute_average_loss(per_example, global_batch_size=global_batch_size)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    dist = strategy.experimental_distribute_dataset(loader)
    steps = 0
    for _ in range(epochs):
        for (x, y), (gx, _gy) in zip(dist, loader, strict=True):
            actual = gx.shape[0]
            losses = strategy.run(step, args=(x, y, actual))
            loss = strategy.reduce("sum", losses, axis=None)
            assert torch.isfinite(loss)
            steps += 1
            if check_copies and strategy.num_replicas_in_sync > 1:
                copies = strategy.experimental_local_results(model)
                for other in copies[1:]:
                    for p, q in zip(copies[0].parameters(), other.parameters(), strict=True):
                        assert torch.equal(p, q)
    return model, steps


def assert_same_params(a: nn.Module, b: nn.Module, exact: bool = False):
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        if exact:
            assert torch.equal(p, q), name
        else:
            torch.testing.assert_close(p, q, **TOL, msg=lambda m, name=name: f"{name}: {m}")


# (num_examples, global batch, epochs): even split; G not a multiple of N; ragged last batch;
# last batch smaller than the number of replicas (1 example over 2 or 3 replicas).
DATASETS = {
    "even": (48, 12, 4),
    "g10": (40, 10, 5),
    "ragged": (47, 10, 4),
    "tiny_last": (41, 10, 4),
}


@pytest.mark.parametrize("n", [1, 2, 3], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("optim_name", ["sgd_momentum", "adam"])
@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
@pytest.mark.parametrize("data", list(DATASETS))
def test_mirrored_matches_one_device(n, optim_name, model_name, data):
    num_examples, global_batch, epochs = DATASETS[data]
    loader = make_loader(model_name, num_examples, global_batch)
    state = initial_state(model_name)
    strategy = td.MirroredStrategy([f"cpu:{i}" for i in range(n)])
    model, steps = train_strategy(strategy, model_name, optim_name, loader, epochs, state,
                                  check_copies=True)
    assert steps >= 16
    reference = train_plain(model_name, optim_name, loader, epochs, state)
    # training really moved the parameters
    moved = max((p - state[k]).abs().max().item() for k, p in model.named_parameters())
    assert moved > 1e-3
    assert_same_params(model, reference)


@pytest.mark.parametrize("optim_name", ["sgd_momentum", "adam"])
@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
def test_one_device_bitwise_equal(optim_name, model_name):
    loader = make_loader(model_name, 47, 10)
    state = initial_state(model_name)
    strategy = td.OneDeviceStrategy("cpu")
    model, steps = train_strategy(strategy, model_name, optim_name, loader, 4, state)
    assert steps == 20
    reference = train_plain(model_name, optim_name, loader, 4, state, exact_formula=True)
    assert_same_params(model, reference, exact=True)


def test_copies_bitwise_equal_after_training():
    loader = make_loader("mlp", 41, 10)
    state = initial_state("mlp")
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    model, _ = train_strategy(strategy, "mlp", "adam", loader, 4, state, check_copies=True)
    copies = strategy.experimental_local_results(model)
    assert len(copies) == 3


@pytest.mark.parametrize("n", [2, 3])
def test_gradient_accumulation_matches(n):
    """Two runs of backward then one step (no zero_grad in between) = one device's sum."""
    loader = make_loader("mlp", 40, 10)
    state = initial_state("mlp")
    strategy = td.MirroredStrategy([f"cpu:{i}" for i in range(n)])
    with strategy.scope():
        model = make_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.load_state_dict(state)

    def backward_only(x, y, g):
        td.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"),
                                global_batch_size=g).backward()

    def apply():
        opt.step()
        opt.zero_grad()

    batches = list(loader)
    dist = list(strategy.experimental_distribute_dataset(batches))
    for i in range(0, len(batches), 2):
        for (x, y), (gx, _) in zip(dist[i:i + 2], batches[i:i + 2], strict=True):
            strategy.run(backward_only, args=(x, y, 2 * gx.shape[0]))
        strategy.run(apply)

    ref = make_mlp()
    ref.load_state_dict(state)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for i in range(0, len(batches), 2):
        for x, y in batches[i:i + 2]:
            (F.cross_entropy(ref(x), y) / 2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_same_params(model, ref)


def test_mirrored_with_explicit_cross_device_ops():
    loader = make_loader("mlp", 47, 10)
    state = initial_state("mlp")
    reference = train_plain("mlp", "adam", loader, 4, state)
    for ops in (td.HierarchicalCopyAllReduce(num_packs=3), td.ReductionToOneDevice(num_packs=2)):
        strategy = td.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], cross_device_ops=ops)
        model, _ = train_strategy(strategy, "mlp", "adam", loader, 4, state)
        assert_same_params(model, reference)
