"""Device names, ReduceOp parsing and the in-process cross-device ops."""

from __future__ import annotations

import pytest
import torch

import torch_distribute as td
from torch_distribute.devices import LogicalDevice, canonicalize, canonicalize_all

pytestmark = pytest.mark.timeout(60)

HAS_CUDA = torch.cuda.is_available()


# -- device strings ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spelling", "index"),
    [("cpu", 0), ("cpu:0", 0), ("cpu:1", 1), ("/cpu:1", 1), ("/device:CPU:2", 2), ("CPU:3", 3),
     ("/job:localhost/replica:0/task:0/device:CPU:1", 1)],
)
def test_cpu_spellings(spelling, index):
    device = canonicalize(spelling)
    assert device == LogicalDevice("cpu", index)
    assert device.name == f"cpu:{index}"
    assert device.torch_device == torch.device("cpu")
    assert not device.is_cuda


def test_torch_device_accepted():
    assert canonicalize(torch.device("cpu")) == LogicalDevice("cpu", 0)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
@pytest.mark.parametrize("spelling", ["cuda:0", "/gpu:0", "/device:GPU:0", "cuda"])
def test_cuda_spellings_with_gpu(spelling):
    device = canonicalize(spelling)
    assert device == LogicalDevice("cuda", 0)
    assert device.torch_device == torch.device("cuda", 0)


@pytest.mark.skipif(HAS_CUDA, reason="only meaningful without a GPU")
@pytest.mark.parametrize("spelling", ["/gpu:0", "cuda:0", "/device:GPU:0", "cuda"])
def test_gpu_without_gpu_is_a_clear_error(spelling):
    with pytest.raises(td.InvalidDeviceError, match="not available") as info:
        canonicalize(spelling)
    assert "cuda:0" in str(info.value)
    assert "cpu" in str(info.value).lower()


@pytest.mark.skipif(HAS_CUDA, reason="only meaningful without a GPU")
def test_mirrored_on_missing_gpu_raises():
    with pytest.raises(td.InvalidDeviceError):
        td.MirroredStrategy(["/gpu:0"])
    with pytest.raises(td.InvalidDeviceError):
        td.OneDeviceStrategy("/gpu:0")


@pytest.mark.parametrize(
    "garbage", ["", "tpu:0", "cpu:-1", "cpu:x", "gpu0", "/cpu:1:2", "cpu 1", "mps", "/device:", "cpu:"]
)
def test_garbage_device_strings(garbage):
    with pytest.raises(td.InvalidDeviceError, match="Unknown device"):
        canonicalize(garbage)


@pytest.mark.parametrize("bad", [None, 1.5, object(), b"cpu"])
def test_non_string_devices(bad):
    with pytest.raises(td.InvalidDeviceError):
        canonicalize(bad)


def test_invalid_device_error_is_value_error():
    assert issubclass(td.InvalidDeviceError, ValueError)
    assert issubclass(td.InvalidDeviceError, td.DistributeError)


@pytest.mark.parametrize(
    "devices",
    [["cpu:0", "/cpu:0"], ["cpu", "cpu:0"], ["cpu:1", "/device:CPU:1"], ["cpu:0", "cpu:1", "cpu:1"]],
)
def test_duplicate_devices(devices):
    with pytest.raises(td.InvalidDeviceError, match="twice"):
        td.MirroredStrategy(devices)


def test_empty_device_list():
    with pytest.raises(td.InvalidDeviceError):
        td.MirroredStrategy([])


def test_canonicalize_all_keeps_order():
    assert [d.name for d in canonicalize_all(["/cpu:2", "cpu", "/device:CPU:1"])] == [
        "cpu:2", "cpu:0", "cpu:1"]


def test_mirrored_strategy_devices():
    strategy = td.MirroredStrategy(["cpu:0", "/cpu:1", "/device:CPU:2"])
    assert strategy.num_replicas_in_sync == 3
    assert [d.name for d in strategy.extended.worker_devices] == ["cpu:0", "cpu:1", "cpu:2"]


@pytest.mark.skipif(HAS_CUDA, reason="default devices are the GPUs when present")
def test_mirrored_default_devices_is_one_cpu():
    strategy = td.MirroredStrategy()
    assert strategy.num_replicas_in_sync == 1
    assert [d.name for d in strategy.extended.worker_devices] == ["cpu:0"]


def test_nccl_on_cpu_devices_raises():
    with pytest.raises(td.InvalidDeviceError, match="NcclAllReduce") as info:
        td.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=td.NcclAllReduce())
    assert "cpu:0" in str(info.value)


def test_cross_device_ops_wrong_type():
    with pytest.raises(td.InvalidArgumentError):
        td.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops="nccl")


@pytest.mark.parametrize("num_packs", [0, -1, 1.5])
def test_bad_num_packs(num_packs):
    with pytest.raises(td.InvalidArgumentError):
        td.HierarchicalCopyAllReduce(num_packs=num_packs)


def test_default_cross_device_ops_for_cpu():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    assert isinstance(strategy.extended.cross_device_ops, td.ReductionToOneDevice)


# -- ReduceOp ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [("sum", td.ReduceOp.SUM), ("SUM", td.ReduceOp.SUM), ("Sum", td.ReduceOp.SUM),
     ("mean", td.ReduceOp.MEAN), ("MEAN", td.ReduceOp.MEAN),
     (td.ReduceOp.SUM, td.ReduceOp.SUM), (td.ReduceOp.MEAN, td.ReduceOp.MEAN)],
)
def test_reduce_op_from_value(value, expected):
    assert td.ReduceOp.from_value(value) is expected


@pytest.mark.parametrize("bad", ["max", "", "avg", None, 1, "sum "])
def test_bad_reduce_op(bad):
    with pytest.raises(td.InvalidReduceOpError, match="reduce op"):
        td.ReduceOp.from_value(bad)


def test_bad_reduce_op_through_strategy():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    value = strategy.run(lambda: torch.tensor(1.0) * td.get_replica_context().replica_id_in_sync_group)
    with pytest.raises(td.InvalidReduceOpError):
        strategy.reduce("max", value, axis=None)


# -- cross-device ops ------------------------------------------------------------------------

OPS = [
    pytest.param(lambda: td.ReductionToOneDevice(), id="to_one"),
    pytest.param(lambda: td.ReductionToOneDevice(reduce_to_device="cpu:0"), id="to_one_cpu0"),
    pytest.param(lambda: td.ReductionToOneDevice(num_packs=2), id="to_one_packs2"),
    pytest.param(lambda: td.HierarchicalCopyAllReduce(num_packs=1), id="hier1"),
    pytest.param(lambda: td.HierarchicalCopyAllReduce(num_packs=3), id="hier3"),
]


def _replica_tensors(num_replicas: int) -> list[list[torch.Tensor]]:
    """Mixed shapes and dtypes, exact in float (small integers)."""
    out = []
    for r in range(num_replicas):
        out.append([
            torch.arange(6, dtype=torch.float32).reshape(2, 3) + r,
            torch.tensor(float(10 * (r + 1))),
            torch.arange(4, dtype=torch.int64) * (r + 1),
            torch.full((5,), 2.0 ** r, dtype=torch.float64),
            torch.ones(3, 1, 2, dtype=torch.float32) * (r - 1),
            torch.tensor([r, r + 1], dtype=torch.int32),
        ])
    return out


def _expected_sum(per_replica: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [sum(ts[1:], ts[0].clone()) for ts in zip(*per_replica, strict=True)]


@pytest.mark.parametrize("make_ops", OPS)
@pytest.mark.parametrize("num_replicas", [1, 2, 3, 4])
def test_batch_reduce_sum_and_mean(make_ops, num_replicas):
    ops = make_ops()
    per_replica = _replica_tensors(num_replicas)
    expected = _expected_sum(per_replica)
    summed = ops.batch_reduce("sum", per_replica, torch.device("cpu"))
    assert len(summed) == len(expected)
    for got, want in zip(summed, expected, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    means = ops.batch_reduce(td.ReduceOp.MEAN, per_replica, torch.device("cpu"))
    for got, want in zip(means, expected, strict=True):
        assert got.shape == want.shape
        if want.is_floating_point():
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want / num_replicas, atol=0, rtol=0)
        else:
            # Integer MEAN is exact (float64), as strategy.reduce and TF's truediv give.
            assert got.dtype == torch.float64
            assert torch.equal(got, want.double() / num_replicas)


@pytest.mark.parametrize("make_ops", OPS)
@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_batch_all_reduce(make_ops, num_replicas):
    ops = make_ops()
    per_replica = _replica_tensors(num_replicas)
    originals = [[t.clone() for t in ts] for ts in per_replica]
    expected = _expected_sum(per_replica)
    result = ops.batch_all_reduce("sum", per_replica)
    assert len(result) == num_replicas
    for replica_result in result:
        for got, want in zip(replica_result, expected, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
    # inputs are untouched
    for ts, orig in zip(per_replica, originals, strict=True):
        for t, o in zip(ts, orig, strict=True):
            assert torch.equal(t, o)
    # each replica gets its own buffer: writing into one result leaves the others alone
    if num_replicas > 1:
        result[0][0].add_(100)
        assert torch.equal(result[1][0], expected[0])
    mean = ops.batch_all_reduce("mean", per_replica)
    for replica_result in mean:
        torch.testing.assert_close(replica_result[0], expected[0] / num_replicas, atol=0, rtol=0)
        torch.testing.assert_close(replica_result[3], expected[3] / num_replicas, atol=0, rtol=0)


@pytest.mark.parametrize("make_ops", OPS)
def test_single_reduce_and_all_reduce(make_ops):
    ops = make_ops()
    values = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]), torch.tensor([5.0, 6.0])]
    assert torch.equal(ops.reduce("sum", values, torch.device("cpu")), torch.tensor([9.0, 12.0]))
    assert torch.equal(ops.reduce("mean", values, torch.device("cpu")), torch.tensor([3.0, 4.0]))
    results = ops.all_reduce("sum", values)
    assert len(results) == 3
    for r in results:
        assert torch.equal(r, torch.tensor([9.0, 12.0]))
    assert torch.equal(values[0], torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("make_ops", OPS)
def test_reduce_shape_mismatch(make_ops):
    with pytest.raises(td.InvalidArgumentError, match="shape"):
        make_ops().reduce("sum", [torch.zeros(2), torch.zeros(3)], torch.device("cpu"))


@pytest.mark.parametrize("make_ops", OPS)
def test_reduce_bad_op(make_ops):
    with pytest.raises(td.InvalidReduceOpError):
        make_ops().reduce("max", [torch.zeros(2), torch.zeros(2)], torch.device("cpu"))


def test_broadcast():
    ops = td.ReductionToOneDevice()
    t = torch.arange(3.0)
    copies = ops.broadcast(t, [torch.device("cpu")] * 3)
    assert copies[0] is t
    for c in copies[1:]:
        assert torch.equal(c, t) and c.data_ptr() != t.data_ptr()


@pytest.mark.parametrize("make_ops", OPS)
def test_strategy_with_explicit_ops(make_ops):
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], cross_device_ops=make_ops())

    def fn():
        ctx = td.get_replica_context()
        r = ctx.replica_id_in_sync_group
        return ctx.all_reduce("sum", {"a": torch.tensor([float(r), 1.0]),
                                      "b": torch.tensor([r], dtype=torch.int64)})

    out = strategy.run(fn)
    for value in strategy.experimental_local_results(out["a"]):
        assert torch.equal(value, torch.tensor([3.0, 3.0]))
    for value in strategy.experimental_local_results(out["b"]):
        assert torch.equal(value, torch.tensor([3]))
    per_replica = td.PerReplica([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(4.0)])
    assert torch.equal(strategy.reduce("sum", per_replica, axis=None), torch.tensor(7.0))
    assert torch.equal(strategy.extended.reduce_to("mean", per_replica, "cpu:0"),
                       torch.tensor(7.0 / 3))
    a, b = strategy.extended.batch_reduce_to(
        "sum", [(per_replica, "cpu:0"), (td.PerReplica([torch.ones(2)] * 3), None)])
    assert torch.equal(a, torch.tensor(7.0)) and torch.equal(b, torch.full((2,), 3.0))


@pytest.mark.parametrize("num_packs", [1, 2, 3, 5])
@pytest.mark.parametrize("ops_class", [td.ReductionToOneDevice, td.HierarchicalCopyAllReduce])
def test_many_tensors_packed(ops_class, num_packs):
    """Many tensors of one dtype split into packs: every one comes back in place and exact."""
    ops = ops_class(num_packs=num_packs)
    shapes = [(3,), (2, 2), (1,), (7,), (), (4, 1), (5,), (2, 3, 1)]
    per_replica = [
        [torch.arange(int(torch.tensor(s).prod()) if s else 1, dtype=torch.float32).reshape(s) + 100 * r + i
         for i, s in enumerate(shapes)]
        for r in range(3)
    ]
    expected = _expected_sum(per_replica)
    for got, want in zip(ops.batch_reduce("sum", per_replica, torch.device("cpu")), expected, strict=True):
        assert got.shape == want.shape and torch.equal(got, want)
    for replica_result in ops.batch_all_reduce("sum", per_replica):
        for got, want in zip(replica_result, expected, strict=True):
            assert got.shape == want.shape and torch.equal(got, want)
