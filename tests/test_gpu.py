"""GPU paths: CUDA replicas, NCCL, parameters on the host with compute on the GPU, bfloat16.

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


def train_with(strategy, data) -> tuple[nn.Module, torch.optim.Optimizer]:
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

    for x, y in strategy.experimental_distribute_dataset(data):
        strategy.run(step, args=(x, y))
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


def _launch_gpu_workers(nproc: int, *extra: str) -> dict[int, dict]:
    from torch_distribute.cluster.launcher import launch

    out, err = io.StringIO(), io.StringIO()
    code = launch([GPU_WORKER, *extra], nproc, grace_period=2, timeout=180, stdout=out, stderr=err)
    assert code == 0, (out.getvalue() + err.getvalue())[-4000:]
    results = H.parse_results(out.getvalue())
    assert sorted(results) == list(range(nproc)), out.getvalue()[-3000:]
    return results


@pytest.mark.parametrize(("nproc", "implementation"), [
    (1, "nccl"), (1, "auto"), (2, "ring"),
    pytest.param(2, "nccl", marks=pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="NCCL needs a GPU per worker")),
])
def test_multi_worker_on_gpu_matches_one_process(nproc, implementation):
    """Workers share the GPUs round-robin; over Gloo (``ring``) several may share one GPU."""
    results = _launch_gpu_workers(nproc, "--implementation", implementation)
    reference = H.train_reference(2, init_device="cuda")
    for rank, payload in results.items():
        assert payload["param_device"] == f"cuda:{rank % torch.cuda.device_count()}"
        # One worker has no process group: nothing crosses processes.
        assert payload["uses_nccl"] == (nproc > 1 and implementation != "ring")
        torch.testing.assert_close(torch.tensor(payload["params"]), torch.tensor(reference["params"]),
                                   atol=1e-4, rtol=1e-4)
    assert all(results[r]["params"] == results[0]["params"] for r in results)


def test_multi_worker_bfloat16_autocast_trains():
    results = _launch_gpu_workers(1, "--implementation", "nccl", "--bf16", "--epochs", "3")
    losses = results[0]["losses"]
    assert losses[-1] < losses[0]
