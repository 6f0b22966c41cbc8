"""GPU paths: CUDA replicas, NCCL, parameters on the host with compute on the GPU, bfloat16,
and mixed precision (float16 autocast with GradScaler or LossScaleOptimizer inside run, Keras
fit under mixed_float16 / mixed_bfloat16).

Every test here needs a CUDA device and is skipped without one (CI has none); they are run
on a GPU machine by hand. One GPU is enough: several workers share it over Gloo.
"""

from __future__ import annotations

import io
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_distribute as td

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mw_helpers as H  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
    pytest.mark.timeout(240),
]

GPU_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiworker", "mw_gpu.py")


def make_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 4 * 4, 5))


def batches(n_batches: int = 6, global_batch: int = 12):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(global_batch, 1, 8, 8, generator=gen), torch.randint(0, 5, (global_batch,), generator=gen))
            for _ in range(n_batches)]


def train_plain(device: str, data, init_device: str = "cuda") -> nn.Module:
    """The hand-written loop. Modules made in a strategy's scope are created on the
    strategy's (first) device, so their initial values come from that device's generator:
    the reference builds its model there too (``init_device``), as ``torch.device`` does."""
    torch.manual_seed(0)
    with torch.device(init_device):
        model = make_cnn()
    model = model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for x, y in data:
        loss = F.cross_entropy(model(x.to(device)), y.to(device), reduction="none").sum() / x.shape[0]
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def _train(strategy, data, wrap):
    """Train on ``data``; ``wrap`` decorates the distributed step (eager: identity)."""
    with strategy.scope():
        torch.manual_seed(0)
        model = make_cnn()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def step(x, y):
        loss = td.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"), global_batch_size=12)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    @wrap
    def distributed_step(x, y):
        return strategy.reduce("sum", strategy.run(step, args=(x, y)), axis=None)

    for x, y in strategy.experimental_distribute_dataset(data):
        distributed_step(x, y)
    return model, opt, distributed_step


def train_with(strategy, data) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, opt, _ = _train(strategy, data, lambda f: f)
    return model, opt


def assert_close_to(model: nn.Module, reference: nn.Module, atol: float = 1e-5) -> None:
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), atol=atol, rtol=1e-5)


def test_one_device_on_gpu_matches_plain_cuda_loop():
    data = batches()
    model, opt = train_with(td.OneDeviceStrategy("cuda:0"), data)
    assert next(model.parameters()).device.type == "cuda"
    assert_close_to(model, train_plain("cuda", data))


def test_mirrored_on_one_gpu_and_default_devices():
    strategy = td.MirroredStrategy()
    assert [d.name for d in strategy.extended.worker_devices] == [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    data = batches()
    model, _ = train_with(td.MirroredStrategy(["cuda:0"]), data)
    assert_close_to(model, train_plain("cuda", data))


def test_mirrored_gpu_and_cpu_replicas_match_one_device():
    """A CUDA replica and a CPU replica in one strategy: reduced across the two devices."""
    data = batches()
    model, _ = train_with(td.MirroredStrategy(["cuda:0", "cpu:0"]), data)
    assert_close_to(model, train_plain("cpu", data, init_device="cuda"), atol=1e-4)


def test_central_storage_parameters_on_host_compute_on_gpu():
    data = batches()
    strategy = td.CentralStorageStrategy(["cuda:0"], parameter_device="cpu")
    model, opt = train_with(strategy, data)
    assert next(model.parameters()).device.type == "cpu"
    assert all(t.device.type == "cpu" for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    replica_weights = strategy.experimental_local_results(strategy.run(lambda: model[0].weight * 1))
    assert replica_weights[0].device.type == "cuda"
    assert_close_to(model, train_plain("cpu", data, init_device="cpu"), atol=1e-4)


def test_central_storage_default_parameter_device_is_the_only_gpu():
    strategy = td.CentralStorageStrategy(["cuda:0"])
    assert [d.name for d in strategy.extended.parameter_devices] == ["cuda:0"]


def test_nccl_all_reduce_between_gpu_tensors():
    ops = td.NcclAllReduce()
    ops.validate(td.MirroredStrategy(["cuda:0"]).extended.worker_devices)
    values = [[torch.arange(4.0, device="cuda"), torch.ones(2, 2, device="cuda")]]
    out = ops.batch_reduce("sum", values, torch.device("cuda:0"))
    assert torch.equal(out[0].cpu(), torch.arange(4.0))
    with pytest.raises(td.InvalidDeviceError, match="CUDA"):
        ops.validate(td.MirroredStrategy(["cuda:0", "cpu:0"]).extended.worker_devices)


def test_checkpoint_from_gpu_restores_on_cpu_replicas(tmp_path):
    model, opt = train_with(td.OneDeviceStrategy("cuda:0"), batches())
    path = td.Checkpoint(model=model, optimizer=opt).save(tmp_path / "gpu")
    cpu = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with cpu.scope():
        cpu_model = make_cnn()
        cpu_opt = torch.optim.Adam(cpu_model.parameters(), lr=0.01)
        td.Checkpoint(model=cpu_model, optimizer=cpu_opt).restore(path).assert_consumed()
    assert_close_to(cpu_model, model, atol=0)


# -- several replicas on one GPU (logical GPUs) -------------------------------------------------
@pytest.fixture
def logical_gpus():
    """Split GPU 0 into n logical GPUs for the test; undone afterwards."""
    gpu = td.config.list_physical_devices("GPU")[0]

    def split(n: int) -> list[str]:
        td.config.set_logical_device_configuration(gpu, [td.config.LogicalDeviceConfiguration()] * n)
        return [d.name for d in td.config.list_logical_devices("GPU")][:n]

    yield split
    td.config.set_logical_device_configuration(gpu, None)


def train_compiled(strategy, data, mode=None):
    """``train_with`` with the distributed step under ``td.function``; also returns it."""
    model, _, function = _train(strategy, data, td.function(mode=mode))
    return model, function


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("compiled", [False, True])
def test_mirrored_on_logical_gpus_of_one_card_matches_one_device(logical_gpus, n, compiled):
    devices = logical_gpus(n)
    strategy = td.MirroredStrategy(devices)
    assert strategy.num_replicas_in_sync == n
    assert {str(d) for d in strategy.extended.replica_devices} == {"cuda:0"}
    assert not isinstance(strategy.extended.cross_device_ops, td.NcclAllReduce)
    data = batches(global_batch=12)
    if compiled:
        with pytest.warns(UserWarning, match="CUDA graphs are not used"):
            model, function = train_compiled(strategy, data)
        assert function.experimental_get_tracing_count() >= 1  # the replicas share their graphs
    else:
        model, _ = train_with(strategy, data)
    assert_close_to(model, train_plain("cuda", data), atol=1e-4)


def test_default_mirrored_uses_every_logical_gpu_and_nccl_is_refused_between_them(logical_gpus):
    logical_gpus(2)
    assert td.MirroredStrategy().num_replicas_in_sync == torch.cuda.device_count() + 1
    with pytest.raises(td.InvalidDeviceError, match="NCCL refuses two ranks on one device"):
        td.MirroredStrategy(["cuda:0", "cuda:1"], cross_device_ops=td.NcclAllReduce())
    with pytest.raises(td.InvalidDeviceError, match="set_logical_device_configuration"):
        td.MirroredStrategy(["cuda:0", "cuda:0"])


def test_logical_gpu_replicas_run_on_streams_of_their_own(logical_gpus):
    strategy = td.MirroredStrategy(logical_gpus(2))
    streams = strategy.experimental_local_results(strategy.run(lambda: torch.cuda.current_stream().stream_id))
    assert len(set(streams)) == 2
    assert torch.cuda.default_stream().stream_id not in streams


@pytest.mark.parametrize("compiled", [False, True])
def test_central_storage_computing_on_logical_gpus(logical_gpus, compiled):
    strategy = td.CentralStorageStrategy(logical_gpus(2), parameter_device="cpu")
    data = batches()
    model, _ = train_compiled(strategy, data) if compiled else train_with(strategy, data)
    assert next(model.parameters()).device.type == "cpu"
    assert_close_to(model, train_plain("cpu", data, init_device="cpu"), atol=1e-4)


@pytest.mark.parametrize("kind", ["mirrored", "central_storage"])
def test_keras3_model_on_logical_gpus_matches_one_gpu(logical_gpus, kind):
    """A Keras 3 model (KERAS_BACKEND=torch) made in the scope: Keras' own fit on two logical GPUs
    of one card (or computing there with its variables on the host) gives one GPU's weights."""
    pytest.importorskip("keras3_tutorial", reason="needs keras")  # sets KERAS_BACKEND=torch first
    import keras
    import numpy as np

    data = np.random.default_rng(0).random((40, 6), dtype=np.float32)

    def fit(strategy, device):
        keras.utils.set_random_seed(3)
        with strategy.scope() if strategy is not None else keras.device(device):
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dense(2)])
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
        with keras.device(device):
            history = model.fit(data, data[:, :2], batch_size=10, epochs=2, shuffle=False, verbose=0)
        return model.get_weights(), history.history

    if kind == "mirrored":
        strategy = td.MirroredStrategy(logical_gpus(2))
        expected_device = "cuda:0"
    else:
        strategy = td.CentralStorageStrategy(logical_gpus(2), parameter_device="cpu")
        expected_device = "cpu"
    weights, history = fit(strategy, expected_device)
    one_weights, one_history = fit(None, expected_device)
    for actual, expected in zip(weights, one_weights, strict=True):
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
    for key, values in one_history.items():
        np.testing.assert_allclose(history[key], values, rtol=1e-4, atol=1e-6)


def test_logical_gpu_memory_limit_caps_the_process(logical_gpus):
    gpu = td.config.list_physical_devices("GPU")[0]
    with pytest.raises(td.InvalidArgumentError, match="same memory_limit"):
        td.config.set_logical_device_configuration(
            gpu, [td.config.LogicalDeviceConfiguration(1024), td.config.LogicalDeviceConfiguration(2048)])
    td.config.set_logical_device_configuration(gpu, [td.config.LogicalDeviceConfiguration(1024)] * 2)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch.empty(3 * 2**30, dtype=torch.uint8, device="cuda")
    td.config.set_logical_device_configuration(gpu, None)
    torch.empty(3 * 2**30, dtype=torch.uint8, device="cuda")


# -- td.function on CUDA: CUDA graphs -------------------------------------------------------------
def test_td_function_on_one_gpu_uses_cuda_graphs_and_matches_eager(recwarn):
    from torch._dynamo.utils import counters

    skips = counters["inductor"]["cudagraph_skips"]
    data = batches(n_batches=8)
    model, function = train_compiled(td.OneDeviceStrategy("cuda:0"), data)
    assert counters["inductor"]["cudagraph_skips"] == skips
    assert not [w for w in recwarn if "CUDA graphs" in str(w.message)]
    assert_close_to(model, train_plain("cuda", data), atol=1e-5)


def test_td_function_says_once_why_cuda_graphs_were_skipped():
    from torch._dynamo.utils import counters

    strategy = td.OneDeviceStrategy("cuda:0")
    with strategy.scope():
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # A plain tensor (not a parameter or buffer) changed in place in the step: no CUDA graph.
    steps_seen = torch.zeros(1, device="cuda")

    def step(x):
        steps_seen.add_(1)
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    @td.function
    def distributed_step(x):
        return strategy.run(step, args=(x,))

    skips = counters["inductor"]["cudagraph_skips"]
    with pytest.warns(UserWarning, match="CUDA graphs are not used for part of the step") as caught:
        for x in strategy.experimental_distribute_dataset([torch.ones(8, 4)] * 4):
            distributed_step(x)
    assert counters["inductor"]["cudagraph_skips"] > skips
    assert len([w for w in caught if "CUDA graphs" in str(w.message)]) == 1
    assert steps_seen.item() == 4


def test_td_function_with_explicit_reduce_overhead_on_one_gpu():
    data = batches(n_batches=8)
    model, _ = train_compiled(td.OneDeviceStrategy("cuda:0"), data, mode="reduce-overhead")
    assert_close_to(model, train_plain("cuda", data), atol=1e-4)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graphs_asked_for_with_replica_threads_are_refused(logical_gpus, mode):
    """Inductor's CUDA graph trees live in the thread that made them (torch asserts in any other
    thread), so replicas in threads cannot capture them: said before anything is compiled."""
    strategy = td.MirroredStrategy(logical_gpus(2))
    with pytest.raises(td.InvalidArgumentError, match=f"mode={mode!r} captures CUDA graphs"):
        train_compiled(strategy, batches(n_batches=2), mode=mode)


def _launch_gpu_workers(nproc: int, *extra: str) -> dict[int, dict]:
    from torch_distribute.cluster.launcher import launch

    out, err = io.StringIO(), io.StringIO()
    code = launch([GPU_WORKER, *extra], nproc, grace_period=2, timeout=180, stdout=out, stderr=err)
    assert code == 0, (out.getvalue() + err.getvalue())[-4000:]
    results = H.parse_results(out.getvalue())
    assert sorted(results) == list(range(nproc)), out.getvalue()[-3000:]
    return results


@pytest.mark.parametrize(("nproc", "implementation", "compiled"), [
    (1, "nccl", False), (1, "auto", False), (2, "ring", False), (2, "auto", False), (2, "auto", True),
    pytest.param(2, "nccl", False, marks=pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="NCCL needs a GPU per worker")),
])
def test_multi_worker_on_gpu_matches_one_process(nproc, implementation, compiled):
    """Workers share the GPUs round-robin; workers sharing one GPU talk over Gloo (NCCL refuses
    two ranks on one GPU), under ``auto`` too."""
    results = _launch_gpu_workers(nproc, "--implementation", implementation, *(["--compile"] if compiled else []))
    reference = H.train_reference(2, init_device="cuda")
    shared = nproc > torch.cuda.device_count()
    for rank, payload in results.items():
        assert payload["param_device"] == f"cuda:{rank % torch.cuda.device_count()}"
        # One worker has no process group: nothing crosses processes.
        assert payload["uses_nccl"] == (nproc > 1 and implementation != "ring" and not shared)
        torch.testing.assert_close(torch.tensor(payload["params"]), torch.tensor(reference["params"]),
                                   atol=1e-4, rtol=1e-4)
    assert all(results[r]["params"] == results[0]["params"] for r in results)


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="needs workers sharing a GPU")
def test_explicit_nccl_between_workers_sharing_a_gpu_is_refused():
    from torch_distribute.cluster.launcher import launch

    out, err = io.StringIO(), io.StringIO()
    code = launch([GPU_WORKER, "--implementation", "nccl"], 2, grace_period=2, timeout=120, stdout=out, stderr=err)
    assert code != 0
    assert "share GPU" in out.getvalue() + err.getvalue()
    assert "NCCL refuses two ranks on one GPU" in out.getvalue() + err.getvalue()


def test_multi_worker_bfloat16_autocast_trains():
    results = _launch_gpu_workers(1, "--implementation", "nccl", "--bf16", "--epochs", "3")
    losses = results[0]["losses"]
    assert losses[-1] < losses[0]


# -- mixed precision on one GPU ------------------------------------------------------------------
# Devices may not repeat in a strategy (MirroredStrategy(["cuda:0", "cuda:0"]) is refused), so
# with one GPU the strategies under test are OneDeviceStrategy on it and CentralStorageStrategy
# computing on it with the parameters (and the optimizer's update) on the host. A CUDA and a
# CPU replica together are not used with a CUDA GradScaler: torch's GradScaler moves its scale
# and found-inf flags between devices with non_blocking copies, and a non_blocking copy from
# the GPU to the host may be read before it lands.
AMP_STRATEGIES = {
    "one": lambda: td.OneDeviceStrategy("cuda:0"),
    "central": lambda: td.CentralStorageStrategy(["cuda:0"], parameter_device="cpu"),
}
AMP_GLOBAL_BATCH = 12
AMP_STEPS = 8
AMP_INJECT_STEP = 4
AMP_INIT_SCALE = 2.0**8
AMP_GROWTH_INTERVAL = 3
AMP_LR = 0.1


@pytest.fixture(autouse=True)
def _float32_policy_afterwards():
    yield
    td.keras.mixed_precision.set_global_policy("float32")


def amp_data(inject_row: int | None = None):
    """Global batches on the host; with ``inject_row``, that row of batch ``AMP_INJECT_STEP``
    holds an inf (a non-finite loss, hence non-finite gradients, in that step only)."""
    data = batches(n_batches=AMP_STEPS, global_batch=AMP_GLOBAL_BATCH)
    if inject_row is not None:
        x, y = data[AMP_INJECT_STEP]
        x = x.clone()
        x[inject_row, 0, 0, 0] = float("inf")
        data[AMP_INJECT_STEP] = (x, y)
    return data


def amp_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cuda", init_scale=AMP_INIT_SCALE, growth_interval=AMP_GROWTH_INTERVAL)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


def train_fp16_plain(initial: list[torch.Tensor], data) -> tuple[torch.Tensor, list[float]]:
    """The hand-written float16 loop on ``cuda``, as PyTorch documents automatic mixed
    precision, from the given initial parameters; returns the parameters and the scales."""
    model = make_cnn().to("cuda")
    with torch.no_grad():
        for p, value in zip(model.parameters(), initial, strict=True):
            p.copy_(value)
    optimizer = torch.optim.SGD(model.parameters(), lr=AMP_LR)
    scaler = amp_scaler()
    scales = []
    for x, y in data:
        x, y = x.to("cuda"), y.to("cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y, reduction="none").sum() / x.shape[0]
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
    return flat(model), scales


def train_fp16_with(strategy, data, loss_scale_optimizer: bool = False):
    """float16 autocast inside ``strategy.run``, with a GradScaler used as PyTorch documents
    it, or with ``td.mixed_precision.LossScaleOptimizer``. Returns the initial and the final
    parameters (flat, on the host), the scale after every step, whether the parameters stayed
    bitwise unchanged over step ``AMP_INJECT_STEP``, and the model."""
    with strategy.scope():
        torch.manual_seed(0)
        model = make_cnn()
        optimizer = torch.optim.SGD(model.parameters(), lr=AMP_LR)
        if loss_scale_optimizer:
            optimizer = td.mixed_precision.LossScaleOptimizer(
                optimizer, initial_scale=AMP_INIT_SCALE, dynamic_growth_steps=AMP_GROWTH_INTERVAL)
    initial = [p.detach().to("cpu", copy=True) for p in model.parameters()]
    scaler = None if loss_scale_optimizer else amp_scaler()

    def step(x, y):
        assert x.device.type == "cuda"
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x)
            assert logits.dtype == torch.float16
            loss = td.compute_average_loss(F.cross_entropy(logits, y, reduction="none"),
                                           global_batch_size=AMP_GLOBAL_BATCH)
        if loss_scale_optimizer:
            optimizer.get_scaled_loss(loss).backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
        return loss

    scales, unchanged = [], None
    for index, (x, y) in enumerate(strategy.experimental_distribute_dataset(data)):
        before = flat(model)
        strategy.run(step, args=(x, y))
        scales.append(optimizer.loss_scale if loss_scale_optimizer else scaler.get_scale())
        if index == AMP_INJECT_STEP:
            unchanged = torch.equal(before, flat(model))
    return initial, flat(model), scales, unchanged, model


def assert_same_fp16_update(params: torch.Tensor, reference: torch.Tensor, initial: torch.Tensor) -> None:
    """The two runs moved the parameters by the same amount, to float16 accuracy.

    Both compute in float16 on the same GPU from the same parameters and rows, but cuDNN may
    pick a different algorithm (another summation order) in each run, and an activation
    rounded to float16 then differs by an ulp (2**-11 relative), which propagates into the
    gradients and the updates: a relative difference of the updates of about 1e-3, not 1e-6.
    A wrong gradient (a replica's share missing or doubled, scaled or unscaled twice) differs
    by 10% or more, so 1e-2 tells the two apart.
    """
    moved, moved_reference = params - initial, reference - initial
    relative = float((moved - moved_reference).norm() / moved_reference.norm())
    assert relative < 1e-2, f"updates differ by {relative:.2e} (relative L2)"


@pytest.mark.parametrize("loss_scale_optimizer", [False, True], ids=["grad_scaler", "loss_scale_optimizer"])
@pytest.mark.parametrize("inject_row", [None, 0, AMP_GLOBAL_BATCH - 1])
@pytest.mark.parametrize("name", list(AMP_STRATEGIES))
def test_float16_loss_scaling_inside_run_matches_the_hand_written_loop(name, inject_row, loss_scale_optimizer):
    """GradScaler("cuda") used as PyTorch documents it inside run, and LossScaleOptimizer:
    the same parameters and scales as the hand-written float16 loop on the same global batches;
    an inf in one replica's rows skips that step (parameters bitwise unchanged) and halves the
    scale once."""
    data = amp_data(inject_row)
    strategy = AMP_STRATEGIES[name]()
    initial, params, scales, unchanged, model = train_fp16_with(strategy, data, loss_scale_optimizer)
    want_params, want_scales = train_fp16_plain(initial, data)

    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert next(model.parameters()).device.type == ("cuda" if name == "one" else "cpu")
    assert scales == want_scales  # the same steps skipped, the same growth
    assert_same_fp16_update(params, want_params, torch.cat([t.reshape(-1) for t in initial]))
    if inject_row is None:
        assert max(scales) > AMP_INIT_SCALE and unchanged is False
    else:
        assert unchanged is True
        assert scales[AMP_INJECT_STEP] == scales[AMP_INJECT_STEP - 1] / 2
        assert scales[AMP_INJECT_STEP + 1] == scales[AMP_INJECT_STEP]  # halved once, not again
        assert torch.isfinite(params).all()


def learnable_images(n: int = 384):
    """8x8 images whose label is learnable: a class template plus noise."""
    gen = torch.Generator().manual_seed(2)
    labels = torch.randint(0, 5, (n,), generator=gen)
    templates = torch.rand(5, 1, 8, 8, generator=gen)
    images = 0.5 * templates[labels] + 0.5 * torch.rand(n, 1, 8, 8, generator=gen)
    return images, labels


@pytest.mark.parametrize("name", list(AMP_STRATEGIES))
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_keras_fit_under_a_mixed_policy_on_gpu(policy, name):
    """fit computes in the policy's dtype on the GPU, keeps the parameters, loss and outputs
    in float32, trains, and under mixed_float16 scales the loss (LossScaleOptimizer)."""
    td.keras.mixed_precision.set_global_policy(policy)
    compute_dtype = torch.float16 if policy == "mixed_float16" else torch.bfloat16
    x, y = learnable_images()
    strategy = AMP_STRATEGIES[name]()
    torch.manual_seed(0)
    with strategy.scope():
        model = td.keras.Model(make_cnn())
    model.compile(optimizer=td.keras.optimizers.Adam(learning_rate=1e-2),
                  loss=td.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    computed_in = set()
    model.module[0].register_forward_hook(lambda _m, _i, out: computed_in.add((out.dtype, out.device.type)))
    history = model.fit(x, y, batch_size=32, epochs=4, verbose=0)

    assert computed_in == {(compute_dtype, "cuda")}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert next(model.parameters()).device.type == ("cuda" if name == "one" else "cpu")
    losses = history.history["loss"]
    assert all(isinstance(v, float) for v in losses)
    assert losses[-1] < losses[0], losses
    assert model.predict(x[:4], verbose=0).dtype == torch.float32
    scaled = isinstance(model.optimizer, td.mixed_precision.LossScaleOptimizer)
    assert scaled == (policy == "mixed_float16")
    if scaled:
        assert 0 < model.optimizer.loss_scale < float("inf")


@pytest.mark.parametrize("size", [None, 0, 2])
def test_prefetch_to_the_gpu_on_a_side_stream_gives_the_same_batches(size):
    strategy = td.MirroredStrategy(["cuda:0", "cpu:0"])
    data = batches(4)
    pinned = [(x.pin_memory(), y.pin_memory()) for x, y in data]
    dist = strategy.experimental_distribute_dataset(
        pinned, options=td.InputOptions(experimental_per_replica_buffer_size=size))
    assert dist.buffer_size == (1 if size is None else size)  # default: one step ahead, a copy to overlap
    for (x, y), (bx, by) in zip(data, dist, strict=True):
        on_gpu, on_cpu = strategy.experimental_local_results(bx)
        assert on_gpu.is_cuda and not on_cpu.is_cuda
        assert torch.equal((on_gpu * 2).cpu(), x[:6] * 2)  # used on the current stream after its copy
        assert torch.equal(torch.cat([t.cpu() for t in strategy.experimental_local_results(by)]), y)


def test_a_per_replica_dataset_placed_on_the_gpu_is_made_there():
    from torch_distribute.input import DatasetFromFunction

    options = td.InputOptions(experimental_replication_mode=td.InputReplicationMode.PER_REPLICA,
                              experimental_place_dataset_on_device=True, experimental_fetch_to_device=False)
    dist = DatasetFromFunction.from_function(lambda ctx: [torch.ones(2, 3)], [torch.device("cuda", 0)],
                                             options=options)
    batch = next(iter(dist))  # one replica: the tensor itself, not a PerReplica
    assert batch.is_cuda


def test_fully_sharded_on_a_gpu_builds_what_one_device_builds():
    """A model made in ``FullyShardedStrategy``'s scope on a GPU worker draws its initial
    values from that GPU's generator, as in ``OneDeviceStrategy``'s scope (and as
    ``torch.device("cuda")`` does): the same seed gives the same weights, bit for bit."""
    import torch.distributed as dist

    from torch_distribute.cluster import SimpleClusterResolver

    torch.manual_seed(0)
    with td.OneDeviceStrategy("cuda:0").scope():
        one_device = make_cnn()
    strategy = td.FullyShardedStrategy(device="cuda:0", cluster_resolver=SimpleClusterResolver({}))
    try:
        torch.manual_seed(0)
        with strategy.scope():
            sharded = make_cnn()
            torch.optim.SGD(sharded.parameters(), lr=0.1)  # the optimizer's creation shards the model
        for (name, want), got in zip(one_device.state_dict().items(), sharded.state_dict().values(), strict=True):
            whole = got.full_tensor() if hasattr(got, "full_tensor") else got
            assert whole.device.type == "cuda", name
            assert torch.equal(whole, want), name
    finally:
        strategy.extended.worker_group.close()
    assert not dist.is_initialized()
