"""``td.config``: device listing and logical devices (the GPU side is in test_gpu.py), the
backend choice for workers sharing a GPU, and how ``td.function`` picks CUDA graphs."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_distribute as td
from torch_distribute.collectives.communication import CommunicationImplementation
from torch_distribute.collectives.group_rendezvous import _backend
from torch_distribute.devices import LogicalDevice, share_a_gpu


@pytest.fixture
def cpu():
    device = td.config.list_physical_devices("CPU")[0]
    yield device
    td.config.set_logical_device_configuration(device, None)


def test_physical_and_logical_devices_are_listed_as_tensorflow_names_them(cpu):
    assert cpu.name == "/physical_device:CPU:0" and cpu.device_type == "CPU"
    assert td.config.list_physical_devices("gpu") == td.config.list_physical_devices("GPU")
    assert [d.name for d in td.config.list_logical_devices("CPU")] == ["cpu:0"]
    assert td.config.get_logical_device_configuration(cpu) is None


def test_logical_cpus_can_be_listed_and_used_by_a_strategy(cpu):
    td.config.set_logical_device_configuration(cpu, [td.config.LogicalDeviceConfiguration()] * 3)
    logical = td.config.list_logical_devices("CPU")
    assert [d.name for d in logical] == ["cpu:0", "cpu:1", "cpu:2"]
    assert all(d.device_type == "CPU" for d in logical)
    assert len(td.config.get_logical_device_configuration("/physical_device:CPU:0")) == 3
    strategy = td.MirroredStrategy(logical)
    assert strategy.num_replicas_in_sync == 3
    # TensorFlow's MirroredStrategy() without GPUs takes every logical CPU device (the input
    # guide's cells rely on it); the one-process-per-worker and central strategies take one.
    assert td.MirroredStrategy().num_replicas_in_sync == 3
    assert td.MultiWorkerMirroredStrategy().num_replicas_in_sync == 1
    td.config.set_logical_device_configuration(cpu, None)
    assert len(td.config.list_logical_devices("CPU")) == 1
    assert td.MirroredStrategy().num_replicas_in_sync == 1


@pytest.mark.parametrize(("device", "configurations", "error", "match"), [
    ("/physical_device:GPU:7", [td.config.LogicalDeviceConfiguration()], td.InvalidDeviceError,
     "not a physical device"),
    ("/physical_device:CPU:0", [], td.InvalidArgumentError, "non-empty list"),
    ("/physical_device:CPU:0", [{"memory_limit": 1}], td.InvalidArgumentError, "LogicalDeviceConfiguration"),
    ("/physical_device:CPU:0", [td.config.LogicalDeviceConfiguration(memory_limit=512)], td.InvalidArgumentError,
     "GPUs only"),
])
def test_bad_configurations_are_refused(cpu, device, configurations, error, match):
    with pytest.raises(error, match=match):
        td.config.set_logical_device_configuration(device, configurations)


@pytest.mark.parametrize("limit", [0, -5, 1.5, True])
def test_memory_limit_is_a_positive_number_of_mib(limit):
    with pytest.raises(td.InvalidArgumentError, match="memory_limit"):
        td.config.LogicalDeviceConfiguration(memory_limit=limit)


def test_device_type_filter_is_checked():
    with pytest.raises(td.InvalidDeviceError, match="device_type"):
        td.config.list_logical_devices("TPU")


def test_repeating_a_gpu_points_to_logical_gpus():
    with pytest.raises(td.InvalidDeviceError, match="set_logical_device_configuration"):
        td.MirroredStrategy(["cpu:0", "cpu:0"])


def test_logical_gpus_of_one_card_share_it():
    a, b, c = LogicalDevice("cuda", 0, 0), LogicalDevice("cuda", 1, 0), LogicalDevice("cuda", 2, 1)
    assert a.torch_device == b.torch_device == torch.device("cuda", 0)
    assert share_a_gpu([a, b]) and not share_a_gpu([a, c]) and not share_a_gpu([LogicalDevice("cpu", 0)] * 2)
    assert a.name == "cuda:0" and b.name == "cuda:1" and b.device_type == "GPU"


def test_nccl_ops_refuse_logical_gpus_of_one_card():
    with pytest.raises(td.InvalidDeviceError, match="NCCL refuses two ranks on one device"):
        td.NcclAllReduce().validate([LogicalDevice("cuda", 0, 0), LogicalDevice("cuda", 1, 0)])


@pytest.mark.skipif(not torch.distributed.is_nccl_available() or not torch.cuda.is_available(),
                    reason="the NCCL choice needs CUDA")
def test_workers_sharing_a_gpu_get_gloo_or_a_clear_error():
    auto, nccl = CommunicationImplementation.AUTO, CommunicationImplementation.NCCL
    assert _backend(auto, True, None) == "cpu:gloo,cuda:nccl"
    assert _backend(auto, True, "workers 0 and 1 share GPU GPU-x") == "gloo"
    with pytest.raises(td.InvalidArgumentError, match="NCCL refuses two ranks on one GPU"):
        _backend(nccl, True, "workers 0 and 1 share GPU GPU-x")


def test_backend_without_cuda_is_gloo_and_explicit_nccl_is_refused():
    assert _backend(CommunicationImplementation.AUTO, False, None) == "gloo"
    with pytest.raises(td.InvalidArgumentError, match="needs CUDA devices"):
        _backend(CommunicationImplementation.NCCL, False, None)


# -- td.function's mode on CUDA (the compiled functions are made, not called: no GPU needed) --
def _step(x):
    return x + 1


def test_td_function_picks_cuda_graphs_for_one_gpu_replica_per_process():
    function = td.function(_step)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        function.compiled(_step, (torch.device("cuda", 0),))
        function.compiled(_step, (torch.device("cpu"), torch.device("cpu")))


def test_td_function_says_once_why_replica_threads_get_no_cuda_graphs():
    function = td.function(_step)
    devices = (torch.device("cuda", 0), torch.device("cuda", 0))
    with pytest.warns(UserWarning, match="CUDA graphs are not used: its 2 replicas run in threads") as caught:
        function.compiled(_step, devices)
        function.compiled(_step, devices)
    assert len(caught) == 1
    explicit = td.function(_step, mode="max-autotune-no-cudagraphs")  # no CUDA graphs asked for: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explicit.compiled(_step, devices)
