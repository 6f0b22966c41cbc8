"""The fingerprint exchange's rows (``collectives/exchange.py``): a small reduction combined in
plain Python gives the tensor arithmetic's result bit for bit, in every dtype it accepts."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from torch_distribute.collectives import exchange, fingerprint

TORCH_OPS = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.PRODUCT: torch.mul,
             dist.ReduceOp.MAX: torch.maximum, dist.ReduceOp.MIN: torch.minimum}


def _rank_order(parts: list[torch.Tensor], op) -> torch.Tensor:
    total = parts[0].clone()
    for part in parts[1:]:
        total = TORCH_OPS[op](total, part)
    return total


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        torch.nan_to_num(a.double(), nan=0.5), torch.nan_to_num(b.double(), nan=0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.bfloat16,
                                   torch.int64, torch.int32, torch.uint8, torch.bool])
@pytest.mark.parametrize("op", list(TORCH_OPS))
def test_combine_matches_tensor_arithmetic(dtype, op):
    rng = random.Random(f"{dtype}{op}")
    torch.manual_seed(rng.randrange(2**31))
    for _ in range(60):
        shape = rng.choice([(), (1,), (3,), (2, 4)])
        workers = rng.randint(1, 5)
        if dtype.is_floating_point:
            scale = rng.choice([1e-3, 1.0, 3e4, 6e4, 1e38])  # 6e4 and 1e38 overflow float16/float32 sums
            parts = [(torch.randn(shape) * scale).to(dtype) for _ in range(workers)]
            if rng.random() < 0.2:
                parts[rng.randrange(workers)].view(-1)[0] = rng.choice([float("nan"), float("inf"), -0.0])
        elif dtype is torch.bool:
            parts = [torch.rand(shape) < 0.5 for _ in range(workers)]
        else:
            info = torch.iinfo(dtype)
            parts = [torch.randint(info.min, info.max, shape, dtype=torch.int64).to(dtype) for _ in range(workers)]
        assert exchange.can_carry(parts[0], op)
        rows = [exchange.small_values(part) for part in parts]
        combined = exchange.combine(rows, op, parts[0])
        assert _same_bits(combined, _rank_order(parts, op)), (parts, combined)


def test_row_layout():
    head = fingerprint.encode("all_reduce", "reduce", torch.float32, (2,))
    assert len(head) == exchange.HEAD_BYTES
    rows = torch.stack([exchange.pack(head, exchange.small_values(torch.tensor([1.0, -2.0]))),
                        exchange.pack(head, b"\x01")])
    assert rows.shape == (2, exchange.WIDTH) and rows.dtype == torch.int64
    heads, payloads = zip(*exchange.rows(rows), strict=True)
    assert list(heads) == [head, head]
    assert [len(p) for p in payloads] == [exchange.PAYLOAD_BYTES] * 2
    assert payloads[1] == b"\x01" + b"\x00" * (exchange.PAYLOAD_BYTES - 1)


def test_what_cannot_ride_in_an_exchange():
    assert not exchange.can_carry(torch.zeros(exchange.SMALL + 1), dist.ReduceOp.SUM)
    assert not exchange.can_carry(torch.zeros(2, dtype=torch.complex64), dist.ReduceOp.SUM)
    assert not exchange.can_carry(torch.zeros(2), dist.ReduceOp.AVG)
