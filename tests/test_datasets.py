"""Tests for torch_distribute.datasets: IDX reading, Fashion-MNIST, sklearn digits, loaders."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest
import torch

from torch_distribute.datasets import (
    load_digits_28x28,
    load_fashion_mnist,
    load_image_classification_data,
    make_loader,
    read_idx,
)
from torch_distribute.errors import DatasetError, InvalidArgumentError

_TYPE_CODES = {
    np.dtype(np.uint8): 0x08,
    np.dtype(np.int8): 0x09,
    np.dtype(np.int16): 0x0B,
    np.dtype(np.int32): 0x0C,
    np.dtype(np.float32): 0x0D,
    np.dtype(np.float64): 0x0E,
}

FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


def encode_idx(array: np.ndarray) -> bytes:
    """The IDX encoding of ``array``: magic, big-endian int32 dims, big-endian data."""
    code = _TYPE_CODES[array.dtype]
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}i", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_idx(path, array: np.ndarray) -> None:
    data = encode_idx(array)
    path.write_bytes(gzip.compress(data) if str(path).endswith(".gz") else data)


def write_fashion_dir(directory, n_train: int = 6, n_test: int = 4, gz: bool = True):
    rng = np.random.default_rng(0)
    arrays = {
        FILES[0]: rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        FILES[1]: rng.integers(0, 10, n_train, dtype=np.uint8),
        FILES[2]: rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        FILES[3]: rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    arrays[FILES[0]][0, 0, 0] = 255  # so the maximum is exactly 1.0 after scaling
    for name, array in arrays.items():
        write_idx(directory / (name if gz else name.removesuffix(".gz")), array)
    return arrays


# --- read_idx ---------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".gz", ""])
def test_read_idx_round_trips_ubyte_images_and_labels(tmp_path, suffix):
    images = np.arange(3 * 4 * 5, dtype=np.uint8).reshape(3, 4, 5)
    labels = np.array([7, 0, 9], dtype=np.uint8)
    write_idx(tmp_path / f"images{suffix}", images)
    write_idx(tmp_path / f"labels{suffix}", labels)

    got_images = read_idx(tmp_path / f"images{suffix}")
    got_labels = read_idx(str(tmp_path / f"labels{suffix}"))
    assert got_images.dtype == np.uint8 and got_images.shape == (3, 4, 5)
    assert got_labels.dtype == np.uint8 and got_labels.shape == (3,)
    np.testing.assert_array_equal(got_images, images)
    np.testing.assert_array_equal(got_labels, labels)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16, np.int32, np.int8])
def test_read_idx_round_trips_other_types_big_endian(tmp_path, dtype):
    array = (np.arange(6).reshape(2, 3) - 2.5).astype(dtype) * 3
    write_idx(tmp_path / "x.idx", array)
    got = read_idx(tmp_path / "x.idx")
    assert got.dtype == np.dtype(dtype)
    assert got.dtype.isnative
    np.testing.assert_array_equal(got, array)


def test_read_idx_detects_gzip_by_content_not_name(tmp_path):
    array = np.array([1.5, -2.0], dtype=np.float32)
    (tmp_path / "plain-named").write_bytes(gzip.compress(encode_idx(array)))
    np.testing.assert_array_equal(read_idx(tmp_path / "plain-named"), array)


def test_read_idx_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope-idx1-ubyte.gz"
    with pytest.raises(DatasetError, match=r"nope-idx1-ubyte\.gz.*does not exist"):
        read_idx(path)


def test_read_idx_error_is_a_value_error(tmp_path):
    with pytest.raises(ValueError):
        read_idx(tmp_path / "missing")


def test_read_idx_bad_magic(tmp_path):
    data = bytearray(encode_idx(np.zeros(4, dtype=np.uint8)))
    data[0] = 0x1A
    (tmp_path / "bad").write_bytes(bytes(data))
    with pytest.raises(DatasetError, match="bad magic number"):
        read_idx(tmp_path / "bad")


def test_read_idx_unknown_type_code(tmp_path):
    data = bytearray(encode_idx(np.zeros(4, dtype=np.uint8)))
    data[2] = 0x0A
    (tmp_path / "bad.gz").write_bytes(gzip.compress(bytes(data)))
    with pytest.raises(DatasetError, match="unknown type code 0x0A"):
        read_idx(tmp_path / "bad.gz")


@pytest.mark.parametrize("suffix", [".gz", ""])
def test_read_idx_truncated_data(tmp_path, suffix):
    data = encode_idx(np.zeros((2, 28, 28), dtype=np.uint8))[:-10]
    path = tmp_path / f"short{suffix}"
    path.write_bytes(gzip.compress(data) if suffix else data)
    with pytest.raises(DatasetError, match=r"truncated.*\(2, 28, 28\).*1568.*1558"):
        read_idx(path)


def test_read_idx_trailing_bytes(tmp_path):
    (tmp_path / "long").write_bytes(encode_idx(np.zeros(3, dtype=np.uint8)) + b"\x00")
    with pytest.raises(DatasetError, match="longer than its header says"):
        read_idx(tmp_path / "long")


def test_read_idx_truncated_header_and_gzip(tmp_path):
    (tmp_path / "tiny").write_bytes(b"\x00\x00")
    with pytest.raises(DatasetError, match="too short"):
        read_idx(tmp_path / "tiny")
    (tmp_path / "hdr").write_bytes(bytes([0, 0, 0x08, 3]) + struct.pack(">i", 5))
    with pytest.raises(DatasetError, match="truncated.*3 dimensions"):
        read_idx(tmp_path / "hdr")
    compressed = gzip.compress(encode_idx(np.zeros(100, dtype=np.uint8)))
    (tmp_path / "cut.gz").write_bytes(compressed[: len(compressed) // 2])
    with pytest.raises(DatasetError, match="cannot be decompressed"):
        read_idx(tmp_path / "cut.gz")


# --- load_fashion_mnist -----------------------------------------------------------------------


@pytest.mark.parametrize("gz", [True, False])
def test_load_fashion_mnist_shapes_dtypes_scaling(tmp_path, gz):
    arrays = write_fashion_dir(tmp_path, n_train=6, n_test=4, gz=gz)
    (x_train, y_train), (x_test, y_test) = load_fashion_mnist(tmp_path)

    assert x_train.shape == (6, 28, 28) and x_test.shape == (4, 28, 28)
    assert y_train.shape == (6,) and y_test.shape == (4,)
    assert x_train.dtype == np.float32 and x_test.dtype == np.float32
    assert y_train.dtype == np.int64 and y_test.dtype == np.int64
    assert x_train.min() >= 0.0 and x_train.max() == 1.0
    np.testing.assert_allclose(x_train, arrays[FILES[0]] / 255.0, rtol=1e-6)
    np.testing.assert_allclose(x_test, arrays[FILES[2]] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(y_train, arrays[FILES[1]])
    np.testing.assert_array_equal(y_test, arrays[FILES[3]])


def test_load_fashion_mnist_missing_file_names_it_and_the_expected_names(tmp_path):
    write_fashion_dir(tmp_path)
    (tmp_path / FILES[2]).unlink()
    with pytest.raises(DatasetError, match=r"lacks t10k-images-idx3-ubyte\.gz\. Expected") as info:
        load_fashion_mnist(tmp_path)
    for name in FILES:
        assert name in str(info.value)


def test_load_fashion_mnist_empty_and_absent_dir(tmp_path):
    with pytest.raises(DatasetError, match="lacks train-images-idx3-ubyte.gz, train-labels"):
        load_fashion_mnist(tmp_path)
    with pytest.raises(DatasetError, match="does not exist.*train-images-idx3-ubyte.gz"):
        load_fashion_mnist(tmp_path / "absent")


def test_load_fashion_mnist_count_mismatch(tmp_path):
    write_fashion_dir(tmp_path)
    write_idx(tmp_path / FILES[3], np.zeros(5, dtype=np.uint8))
    with pytest.raises(DatasetError, match="test split has 4 images.*5 labels"):
        load_fashion_mnist(tmp_path)


def test_load_fashion_mnist_wrong_image_shape(tmp_path):
    write_fashion_dir(tmp_path)
    write_idx(tmp_path / FILES[0], np.zeros((6, 28), dtype=np.uint8))
    with pytest.raises(DatasetError, match=r"expected images of shape \(N, 28, 28\)"):
        load_fashion_mnist(tmp_path)


# --- digits -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    return load_digits_28x28(test_fraction=0.2, seed=0)


def test_load_digits_28x28_shapes_range_labels(digits):
    (x_train, y_train), (x_test, y_test) = digits
    assert x_train.shape[1:] == (28, 28) and x_test.shape[1:] == (28, 28)
    assert len(x_train) + len(x_test) == 1797
    assert len(x_test) == round(1797 * 0.2)
    assert len(y_train) == len(x_train) and len(y_test) == len(x_test)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int64
    for x in (x_train, x_test):
        assert x.min() >= 0.0 and x.max() <= 1.0
    assert x_train.max() > 0.9
    assert set(np.unique(np.concatenate([y_train, y_test]))) == set(range(10))


def test_load_digits_28x28_is_deterministic_per_seed(digits):
    (x_train, y_train), (x_test, y_test) = digits
    (x_train2, y_train2), (x_test2, y_test2) = load_digits_28x28(test_fraction=0.2, seed=0)
    np.testing.assert_array_equal(x_train, x_train2)
    np.testing.assert_array_equal(y_test, y_test2)
    (_, y_train3), _ = load_digits_28x28(test_fraction=0.2, seed=1)
    assert not np.array_equal(y_train, y_train3)


def test_load_digits_28x28_rejects_bad_fraction():
    with pytest.raises(InvalidArgumentError, match="test_fraction"):
        load_digits_28x28(test_fraction=1.0)


def test_load_image_classification_data_sources(tmp_path):
    train, test, description = load_image_classification_data(test_fraction=0.5, seed=3)
    assert "digits" in description
    assert len(train[0]) + len(test[0]) == 1797

    write_fashion_dir(tmp_path, n_train=6, n_test=4)
    train, test, description = load_image_classification_data(tmp_path)
    assert "Fashion-MNIST" in description and str(tmp_path) in description
    assert train[0].shape == (6, 28, 28) and test[1].shape == (4,)

    with pytest.raises(InvalidArgumentError, match="only apply to the scikit-learn digits"):
        load_image_classification_data(tmp_path, seed=1)


def test_load_image_classification_data_missing_files_raise(tmp_path):
    with pytest.raises(DatasetError, match="lacks train-images-idx3-ubyte.gz"):
        load_image_classification_data(tmp_path)


# --- make_loader ------------------------------------------------------------------------------


def test_make_loader_shapes_and_dtypes():
    images = np.random.default_rng(0).random((10, 28, 28))
    labels = np.arange(10, dtype=np.uint8)
    batches = list(make_loader(images, labels, batch_size=4, shuffle=False))
    assert [tuple(x.shape) for x, _ in batches] == [(4, 1, 28, 28)] * 2 + [(2, 1, 28, 28)]
    assert all(x.dtype == torch.float32 and y.dtype == torch.int64 for x, y in batches)
    assert torch.equal(torch.cat([y for _, y in batches]), torch.arange(10))

    dropped = list(make_loader(images, labels, batch_size=4, shuffle=False, drop_last=True))
    assert len(dropped) == 2


def test_make_loader_shuffling_is_reproducible():
    images = np.zeros((32, 28, 28), dtype=np.float32)
    labels = np.arange(32)

    def order(seed):
        loader = make_loader(images, labels, batch_size=8, shuffle=True, seed=seed)
        return torch.cat([y for _, y in loader]).tolist()

    first = order(0)
    assert first == order(0)
    assert sorted(first) == list(range(32)) and first != list(range(32))
    assert first != order(1)


def test_make_loader_rejects_bad_input():
    with pytest.raises(DatasetError, match="3 images but 2 labels"):
        make_loader(np.zeros((3, 28, 28)), np.zeros(2), batch_size=2, shuffle=False)
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        make_loader(np.zeros((3, 28, 28)), np.zeros(3), batch_size=0, shuffle=False)


def test_load_digits_28x28_without_sklearn_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(DatasetError, match="pip install scikit-learn"):
        load_digits_28x28()
