"""The tutorial example runs end to end (digits by default, Fashion-MNIST IDX files when given)."""

from __future__ import annotations

import gzip
import os
import re
import struct
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from examples import custom_training_loop  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def _write_idx_gz(path, array: np.ndarray) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_tutorial_on_digits_with_two_cpu_replicas(tmp_path, capsys):
    accuracy = custom_training_loop.main([
        "--strategy", "mirrored", "--devices", "cpu:0,cpu:1", "--epochs", "3",
        "--batch-size-per-replica", "32", "--no-progress", "--checkpoint-dir", str(tmp_path),
    ])
    out = capsys.readouterr().out
    assert "Number of devices: 2" in out
    lines = re.findall(r"Epoch (\d+), Loss: ([\d.]+), Accuracy: ([\d.]+), Test Loss: ([\d.]+), "
                       r"Test Accuracy: ([\d.]+)", out)
    assert [int(line[0]) for line in lines] == [1, 2, 3]
    assert float(lines[-1][1]) < float(lines[0][1])  # the loss goes down
    # The checkpoint of the last epoch (saved every 2 epochs: 1 and 3) restored with no strategy
    # scores exactly what the training run printed for that epoch.
    assert f"without strategy: {lines[-1][4]}" in out
    assert accuracy > 0.8
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-1", "ckpt-2"]


def test_tutorial_reads_fashion_mnist_idx_files(tmp_path, capsys):
    rng = np.random.default_rng(0)
    data = tmp_path / "fashion"
    data.mkdir()
    for prefix, n in (("train", 96), ("t10k", 40)):
        _write_idx_gz(data / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        _write_idx_gz(data / f"{prefix}-labels-idx1-ubyte.gz", rng.integers(0, 10, (n,)))
    custom_training_loop.main([
        "--strategy", "one", "--devices", "cpu", "--epochs", "1", "--no-progress",
        "--data-dir", str(data), "--checkpoint-dir", str(tmp_path / "ckpt"),
    ])
    out = capsys.readouterr().out
    assert "Fashion-MNIST" in out and "96" in out
    assert "Epoch 1, Loss:" in out
