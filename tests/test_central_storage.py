"""CentralStorageStrategy: one central copy of the state, replicated compute, same results.

The CPU replicas here take the same code path as GPUs with the parameters on the host:
every replica, replica 0 included, computes with its own copy of the central tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_equivalence import (
    DATASETS,
    assert_same_params,
    initial_state,
    make_loader,
    make_mlp,
    train_plain,
    train_strategy,
)
from torch import nn

import torch_distribute as td
from torch_distribute.strategies.central_storage import CentralStorageExtended

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def cpu_replicas(n: int) -> list[str]:
    return [f"cpu:{i}" for i in range(n)]


@pytest.mark.parametrize("n", [2, 3], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("optim_name", ["sgd_momentum", "adam"])
@pytest.mark.parametrize(("model_name", "data"), [("mlp", "ragged"), ("mlp", "tiny_last"), ("cnn", "g10")])
def test_matches_one_device(n, optim_name, model_name, data):
    num_examples, global_batch, epochs = DATASETS[data]
    loader = make_loader(model_name, num_examples, global_batch)
    state = initial_state(model_name)
    strategy = td.CentralStorageStrategy(cpu_replicas(n))
    model, steps = train_strategy(strategy, model_name, optim_name, loader, epochs, state)
    assert steps >= 16
    moved = max((p - state[k]).abs().max().item() for k, p in model.named_parameters())
    assert moved > 1e-3
    assert_same_params(model, train_plain(model_name, optim_name, loader, epochs, state))


def test_matches_mirrored_bitwise():
    """Same reduction order as MirroredStrategy: the two strategies agree exactly."""
    loader = make_loader("mlp", 47, 10)
    state = initial_state("mlp")
    central, _ = train_strategy(td.CentralStorageStrategy(cpu_replicas(3)), "mlp", "adam", loader, 3, state)
    mirrored, _ = train_strategy(td.MirroredStrategy(cpu_replicas(3)), "mlp", "adam", loader, 3, state)
    assert_same_params(central, mirrored, exact=True)


def test_state_lives_once_and_every_replica_computes_on_a_copy():
    strategy = td.CentralStorageStrategy(cpu_replicas(2))
    assert isinstance(strategy.extended, CentralStorageExtended)
    assert [d.name for d in strategy.extended.parameter_devices] == ["cpu:0"]
    assert [d.name for d in strategy.extended.worker_devices] == ["cpu:0", "cpu:1"]
    with strategy.scope():
        model = nn.Linear(3, 2)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)

    # TensorFlow's central variable has one component; the replicas compute with copies of it.
    assert strategy.experimental_local_results(model.weight) == (model.weight,)
    seen = strategy.extended.local_copies(strategy.run(lambda: model.weight))
    assert len(seen) == 2
    assert all(w is not model.weight for w in seen)  # replica 0 too: a copy of the central value
    assert seen[0].data_ptr() != seen[1].data_ptr() != model.weight.data_ptr()

    def step(x):
        model(x).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    strategy.run(step, args=(td.PerReplica([torch.ones(1, 3), 2 * torch.ones(1, 3)]),))
    # The optimizer's state exists once, for the central tensors.
    assert set(optimizer.state) == {model.weight, model.bias}
    # The replicas read the updated central values on the next step.
    after = strategy.experimental_local_results(strategy.run(lambda: model.weight * 1))
    for replica_value in after:
        assert torch.equal(replica_value, model.weight.detach())


@pytest.mark.parametrize("n", [2, 3])
def test_gradient_accumulation_without_zero_grad(n):
    """Two backward passes then one step: the central gradient holds each sum exactly once."""
    loader = make_loader("mlp", 40, 10)
    state = initial_state("mlp")
    strategy = td.CentralStorageStrategy(cpu_replicas(n))
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


def test_zero_grad_in_replica_clears_the_central_gradient():
    strategy = td.CentralStorageStrategy(cpu_replicas(2))
    with strategy.scope():
        layer = nn.Linear(2, 1, bias=False)
        opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    layer.weight.data.zero_()
    x = td.PerReplica([torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])])

    def step(batch):
        layer(batch).sum().backward()
        opt.step()
        opt.zero_grad()

    for expected in (-1.0, -2.0):
        strategy.run(step, args=(x,))
        assert layer.weight.grad is None
        assert torch.equal(layer.weight.detach(), torch.full((1, 2), expected))


def test_batch_norm_statistics_are_averaged_into_the_central_buffers():
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(0)) * 3 + 1

    def run(strategy):
        with strategy.scope():
            torch.manual_seed(0)
            norm = nn.BatchNorm1d(4)
        for batch in strategy.experimental_distribute_dataset([x, x]):
            strategy.run(norm, args=(batch,))
        return norm

    central = run(td.CentralStorageStrategy(cpu_replicas(3)))
    mirrored = run(td.MirroredStrategy(cpu_replicas(3)))
    assert torch.equal(central.running_mean, mirrored.running_mean)
    assert torch.equal(central.running_var, mirrored.running_var)
    assert central.num_batches_tracked.item() == 2
    assert not torch.equal(central.running_mean, torch.zeros(4))


def test_changes_outside_run_reach_every_replica():
    strategy = td.CentralStorageStrategy(cpu_replicas(2))
    with strategy.scope():
        layer = nn.Linear(2, 2)
    strategy.run(lambda: layer.weight * 1)  # copies exist now
    with torch.no_grad():
        layer.weight.fill_(3.0)
    seen = strategy.experimental_local_results(strategy.run(lambda: layer.weight * 1))
    assert all(torch.equal(v, torch.full((2, 2), 3.0)) for v in seen)
    layer.load_state_dict({"weight": torch.eye(2), "bias": torch.zeros(2)})
    seen = strategy.experimental_local_results(strategy.run(lambda: layer.weight * 1))
    assert all(torch.equal(v, torch.eye(2)) for v in seen)
    strategy.extended.update(layer.bias, lambda v, d: v.add_(d), args=(torch.ones(2),))
    seen = strategy.experimental_local_results(strategy.run(lambda: layer.bias * 1))
    assert all(torch.equal(v, torch.ones(2)) for v in seen)


def _trained_with_optimizer(strategy, loader, state):
    with strategy.scope():
        model = make_mlp()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model.load_state_dict(state)

    def step(x, y):
        per_example = F.cross_entropy(model(x), y, reduction="none")
        td.compute_average_loss(per_example, global_batch_size=10).backward()
        optimizer.step()
        optimizer.zero_grad()

    for x, y in strategy.experimental_distribute_dataset(loader):
        strategy.run(step, args=(x, y))
    return model, optimizer


def test_checkpoints_are_interchangeable_with_other_strategies(tmp_path):
    loader = make_loader("mlp", 40, 10)
    state = initial_state("mlp")
    model, optimizer = _trained_with_optimizer(td.CentralStorageStrategy(cpu_replicas(2)), loader, state)
    path = td.Checkpoint(model=model, optimizer=optimizer).save(tmp_path / "central")

    mirrored = td.MirroredStrategy(cpu_replicas(3))
    with mirrored.scope():
        mirrored_model = make_mlp()
        mirrored_opt = torch.optim.Adam(mirrored_model.parameters(), lr=0.01)
    td.Checkpoint(model=mirrored_model, optimizer=mirrored_opt).restore(path).assert_consumed()
    assert_same_params(mirrored_model, model, exact=True)
    mirrored_path = td.Checkpoint(model=mirrored_model, optimizer=mirrored_opt).save(tmp_path / "mirrored")

    back = td.CentralStorageStrategy(cpu_replicas(3))
    with back.scope():
        back_model = make_mlp()
        back_opt = torch.optim.Adam(back_model.parameters(), lr=0.01)
        td.Checkpoint(model=back_model, optimizer=back_opt).restore(mirrored_path).assert_consumed()
    assert_same_params(back_model, model, exact=True)
    assert back_opt.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]
    plain = make_mlp()
    td.Checkpoint(model=plain).read(path).expect_partial()
    assert_same_params(plain, model, exact=True)

    # Training goes on identically from the restored state under both strategies.
    more = make_loader("mlp", 20, 10, seed=5)
    for strategy, net, opt in ((mirrored, mirrored_model, mirrored_opt), (back, back_model, back_opt)):
        def step(x, y, net=net, opt=opt):
            td.compute_average_loss(F.cross_entropy(net(x), y, reduction="none"),
                                    global_batch_size=10).backward()
            opt.step()
            opt.zero_grad()

        for x, y in strategy.experimental_distribute_dataset(more):
            strategy.run(step, args=(x, y))
    assert_same_params(mirrored_model, back_model)


def test_one_compute_device_elsewhere_than_the_parameters():
    """One replica computing on cpu:1 with the central state on cpu:0 is still exact."""
    loader = make_loader("mlp", 47, 10)
    state = initial_state("mlp")
    strategy = td.CentralStorageStrategy(["cpu:1"], parameter_device="cpu:0")
    assert isinstance(strategy.extended, CentralStorageExtended)
    model, _ = train_strategy(strategy, "mlp", "sgd_momentum", loader, 2, state)
    assert_same_params(model, train_plain("mlp", "sgd_momentum", loader, 2, state))


def test_defaults_follow_tensorflow():
    only = td.CentralStorageStrategy()  # no GPU here: one CPU replica, state on it
    assert only.num_replicas_in_sync == 1
    assert [d.name for d in only.extended.parameter_devices] == ["cpu:0"]
    single = td.CentralStorageStrategy(["cpu:0"])
    assert not isinstance(single.extended, CentralStorageExtended)
    assert td.CentralStorageStrategy(cpu_replicas(2), parameter_device="/cpu:0").num_replicas_in_sync == 2


def test_bad_devices_are_clear_errors():
    with pytest.raises(td.InvalidDeviceError, match="appears twice"):
        td.CentralStorageStrategy(["cpu:0", "cpu:0"])
    with pytest.raises(td.InvalidDeviceError):
        td.CentralStorageStrategy(cpu_replicas(2), parameter_device="tpu:0")
    if not torch.cuda.is_available():
        with pytest.raises(td.InvalidDeviceError, match="not available"):
            td.CentralStorageStrategy(cpu_replicas(2), parameter_device="cuda:0")


def test_module_made_outside_scope_is_refused():
    strategy = td.CentralStorageStrategy(cpu_replicas(2))
    outside = nn.Linear(2, 1)
    with pytest.raises(td.UnmirroredStateError):
        strategy.run(lambda: outside(torch.ones(1, 2)))
