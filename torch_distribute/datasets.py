"""Small real image-classification datasets for the examples, read from disk, never downloaded.

Two sources, both giving 28x28 grey-scale images as float32 in ``[0, 1]`` and int64 labels:

* **Fashion-MNIST** (or MNIST) from a directory holding the four standard IDX files
  (``train-images-idx3-ubyte.gz`` ...), which you download yourself;
* **scikit-learn's handwritten digits** (1797 8x8 images shipped inside the ``sklearn``
  package), upsampled to 28x28, when no directory is given.

>>> from torch_distribute.datasets import load_image_classification_data, make_loader
>>> (x_train, y_train), (x_test, y_test), description = load_image_classification_data()
>>> x_train.shape[1:], x_train.dtype, y_train.dtype
((28, 28), dtype('float32'), dtype('int64'))
>>> loader = make_loader(x_train, y_train, batch_size=64, shuffle=True, seed=0)
>>> images, labels = next(iter(loader))
>>> tuple(images.shape), labels.dtype
((64, 1, 28, 28), torch.int64)

Nothing in this module touches the network.
"""

from __future__ import annotations

import gzip
import math
import os
import zlib
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from torch_distribute.errors import DatasetError, InvalidArgumentError

__all__ = [
    "FASHION_MNIST_FILES",
    "load_digits_28x28",
    "load_fashion_mnist",
    "load_image_classification_data",
    "make_loader",
    "read_idx",
]

Split = tuple[np.ndarray, np.ndarray]
"""``(images, labels)``: float32 ``(N, 28, 28)`` in ``[0, 1]`` and int64 ``(N,)``."""

# IDX type code -> big-endian numpy dtype.
_IDX_DTYPES: dict[int, str] = {
    0x08: ">u1",
    0x09: ">i1",
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}

#: The four standard Fashion-MNIST / MNIST file names (each may also lack the ``.gz``).
FASHION_MNIST_FILES: dict[str, str] = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}

_GZIP_MAGIC = b"\x1f\x8b"
_IMAGE_SIDE = 28


def _read_bytes(path: str) -> bytes:
    """The file's content, gunzipped when it is gzip (detected by its magic, not its name)."""
    if not os.path.isfile(path):
        if os.path.exists(path):
            raise DatasetError(f"IDX path {path!r} is not a file.")
        raise DatasetError(f"IDX file {path!r} does not exist.")
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] != _GZIP_MAGIC:
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise DatasetError(
            f"IDX file {path!r} looks gzip-compressed but cannot be decompressed "
            f"(truncated or corrupt download?): {e}"
        ) from e


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file (the MNIST / Fashion-MNIST format), gzip-compressed or plain.

    Returns a native-endian array with the file's dtype (``uint8``, ``int8``, ``int16``,
    ``int32``, ``float32`` or ``float64``) and shape. Raises :class:`DatasetError` for a
    missing file, a bad magic number, an unknown type code or a data size that does not
    match the dimensions (a truncated file).

    >>> labels = read_idx("data/train-labels-idx1-ubyte.gz")  # doctest: +SKIP
    >>> labels.shape, labels.dtype  # doctest: +SKIP
    ((60000,), dtype('uint8'))
    """
    path = os.fspath(path)
    data = _read_bytes(path)
    if len(data) < 4:
        raise DatasetError(
            f"IDX file {path!r} is too short ({len(data)} bytes) to hold the 4-byte magic number."
        )
    if data[0] != 0 or data[1] != 0:
        raise DatasetError(
            f"IDX file {path!r} has a bad magic number 0x{data[:4].hex()}: an IDX file starts "
            "with two zero bytes, a type code and the number of dimensions. Is it an IDX file?"
        )
    type_code, ndim = data[2], data[3]
    if type_code not in _IDX_DTYPES:
        known = ", ".join(f"0x{code:02X}" for code in _IDX_DTYPES)
        raise DatasetError(
            f"IDX file {path!r} has unknown type code 0x{type_code:02X}; expected one of {known}."
        )
    header_size = 4 + 4 * ndim
    if len(data) < header_size:
        raise DatasetError(
            f"IDX file {path!r} is truncated: its header declares {ndim} dimensions "
            f"({header_size} header bytes) but the file has only {len(data)} bytes."
        )
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">i4", count=ndim, offset=4))
    if any(d < 0 for d in shape):
        raise DatasetError(f"IDX file {path!r} declares negative dimensions {shape}.")
    dtype = np.dtype(_IDX_DTYPES[type_code])
    expected = math.prod(shape) * dtype.itemsize
    actual = len(data) - header_size
    if actual != expected:
        problem = "truncated" if actual < expected else "longer than its header says"
        raise DatasetError(
            f"IDX file {path!r} is {problem}: dimensions {shape} of {dtype.name} need "
            f"{expected} data bytes, but it has {actual}."
        )
    array = np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=header_size)
    return array.reshape(shape).astype(dtype.newbyteorder("="))


def _find_file(data_dir: str, gz_name: str) -> str | None:
    for name in (gz_name, gz_name.removesuffix(".gz")):
        candidate = os.path.join(data_dir, name)
        if os.path.isfile(candidate):
            return candidate
    return None


def _images_to_float(images: np.ndarray, path: str) -> np.ndarray:
    if images.ndim != 3 or images.shape[1:] != (_IMAGE_SIDE, _IMAGE_SIDE):
        raise DatasetError(
            f"{path!r} holds an array of shape {images.shape}; expected images of shape "
            f"(N, {_IMAGE_SIDE}, {_IMAGE_SIDE})."
        )
    if images.dtype != np.uint8:
        raise DatasetError(
            f"{path!r} holds {images.dtype} images; expected unsigned bytes (IDX type 0x08)."
        )
    return images.astype(np.float32) / np.float32(255.0)


def _labels_to_int64(labels: np.ndarray, path: str) -> np.ndarray:
    if labels.ndim != 1:
        raise DatasetError(
            f"{path!r} holds an array of shape {labels.shape}; expected labels (N,)."
        )
    if not np.issubdtype(labels.dtype, np.integer):
        raise DatasetError(f"{path!r} holds {labels.dtype} labels; expected integers.")
    return labels.astype(np.int64)


def load_fashion_mnist(data_dir: str | os.PathLike[str]) -> tuple[Split, Split]:
    """Read Fashion-MNIST (or MNIST) from the four standard IDX files in ``data_dir``.

    The files are ``train-images-idx3-ubyte.gz``, ``train-labels-idx1-ubyte.gz``,
    ``t10k-images-idx3-ubyte.gz`` and ``t10k-labels-idx1-ubyte.gz``, each also accepted
    without ``.gz``. Returns ``((train_images, train_labels), (test_images, test_labels))``:
    float32 images ``(N, 28, 28)`` in ``[0, 1]`` and int64 labels ``(N,)``.

    >>> (x_train, y_train), (x_test, y_test) = load_fashion_mnist("data/fashion")  # doctest: +SKIP
    >>> x_train.shape, y_test.shape  # doctest: +SKIP
    ((60000, 28, 28), (10000,))
    """
    data_dir = os.fspath(data_dir)
    expected = ", ".join(FASHION_MNIST_FILES.values())
    if not os.path.isdir(data_dir):
        raise DatasetError(
            f"Fashion-MNIST directory {data_dir!r} does not exist; it must hold the files "
            f"{expected} (each may also be uncompressed, without .gz)."
        )
    paths = {key: _find_file(data_dir, name) for key, name in FASHION_MNIST_FILES.items()}
    missing = [FASHION_MNIST_FILES[key] for key, path in paths.items() if path is None]
    if missing:
        raise DatasetError(
            f"Fashion-MNIST directory {data_dir!r} lacks {', '.join(missing)}. Expected the "
            f"four files {expected} (each may also be uncompressed, without .gz)."
        )
    splits = []
    for split in ("train", "test"):
        image_path, label_path = paths[f"{split}_images"], paths[f"{split}_labels"]
        assert image_path is not None and label_path is not None
        images = _images_to_float(read_idx(image_path), image_path)
        labels = _labels_to_int64(read_idx(label_path), label_path)
        if len(images) != len(labels):
            raise DatasetError(
                f"Fashion-MNIST {split} split has {len(images)} images in {image_path!r} but "
                f"{len(labels)} labels in {label_path!r}; the counts must match."
            )
        splits.append((images, labels))
    return splits[0], splits[1]


def load_digits_28x28(test_fraction: float = 0.2, seed: int = 0) -> tuple[Split, Split]:
    """scikit-learn's bundled handwritten digits (1797 images), upsampled to 28x28.

    The 8x8 images (values 0..16) are resized bilinearly (``align_corners=False``), scaled to
    ``[0, 1]`` and split by a permutation seeded with ``seed``, ``test_fraction`` of them
    (rounded, at least one) going to the test split. No download: the data ships inside
    ``sklearn``. Returns the same structure as :func:`load_fashion_mnist`.

    >>> (x_train, y_train), (x_test, y_test) = load_digits_28x28(test_fraction=0.2, seed=0)
    >>> x_train.shape, x_test.shape
    ((1438, 28, 28), (359, 28, 28))
    """
    if (
        isinstance(test_fraction, bool)
        or not isinstance(test_fraction, (int, float))
        or not (0.0 < test_fraction < 1.0)
    ):
        raise InvalidArgumentError(
            f"test_fraction must be a number strictly between 0 and 1, got {test_fraction!r}."
        )
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise DatasetError(
            "load_digits_28x28() needs scikit-learn for its bundled digits dataset: "
            "pip install scikit-learn"
        ) from e
    digits = load_digits()
    small = torch.as_tensor(np.asarray(digits.images), dtype=torch.float32).unsqueeze(1)
    large = torch.nn.functional.interpolate(
        small, size=(_IMAGE_SIDE, _IMAGE_SIDE), mode="bilinear", align_corners=False
    )
    images = (large.squeeze(1) / 16.0).clamp_(0.0, 1.0).numpy().astype(np.float32)
    labels = np.asarray(digits.target, dtype=np.int64)

    n = len(images)
    n_test = min(max(int(round(n * test_fraction)), 1), n - 1)
    order = np.random.default_rng(seed).permutation(n)
    test_idx, train_idx = order[:n_test], order[n_test:]
    return (images[train_idx], labels[train_idx]), (images[test_idx], labels[test_idx])


def load_image_classification_data(
    data_dir: str | os.PathLike[str] | None = None, **kw: Any
) -> tuple[Split, Split, str]:
    """Fashion-MNIST from ``data_dir`` when given, else the scikit-learn digits.

    ``kw`` (``test_fraction``, ``seed``) is passed to :func:`load_digits_28x28`; it is an
    error together with ``data_dir``, whose splits are fixed. Returns ``(train, test,
    description)``, where ``description`` says in a few words where the data came from.

    >>> train, test, description = load_image_classification_data()
    >>> description
    'scikit-learn digits upsampled to 28x28 (1438 train / 359 test images)'
    """
    if data_dir is None:
        train, test = load_digits_28x28(**kw)
        description = (
            f"scikit-learn digits upsampled to 28x28 ({len(train[0])} train / "
            f"{len(test[0])} test images)"
        )
        return train, test, description
    if kw:
        raise InvalidArgumentError(
            f"Options {sorted(kw)} only apply to the scikit-learn digits; Fashion-MNIST from "
            "data_dir has fixed train/test splits. Drop them or drop data_dir."
        )
    train, test = load_fashion_mnist(data_dir)
    description = (
        f"Fashion-MNIST from {os.fspath(data_dir)} ({len(train[0])} train / "
        f"{len(test[0])} test images)"
    )
    return train, test, description


def make_loader(
    images: np.ndarray | torch.Tensor,
    labels: np.ndarray | torch.Tensor,
    batch_size: int,
    shuffle: bool,
    seed: int = 0,
    drop_last: bool = False,
) -> DataLoader:
    """A ``DataLoader`` of ``(images, labels)`` batches: float32 ``(B, 1, H, W)``, int64 ``(B,)``.

    ``images`` is ``(N, H, W)`` (a channel dimension is added) or already ``(N, 1, H, W)``.
    With ``shuffle``, the order comes from a ``torch.Generator`` seeded with ``seed``, so two
    loaders built with the same seed yield the same batches.

    >>> import numpy as np
    >>> loader = make_loader(np.zeros((10, 28, 28)), np.arange(10), batch_size=4, shuffle=False)
    >>> [tuple(x.shape) for x, _ in loader]
    [(4, 1, 28, 28), (4, 1, 28, 28), (2, 1, 28, 28)]
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be a positive int, got {batch_size!r}.")
    x = torch.as_tensor(images, dtype=torch.float32)
    y = torch.as_tensor(labels, dtype=torch.int64)
    if x.dim() == 3:
        x = x.unsqueeze(1)
    elif not (x.dim() == 4 and x.shape[1] == 1):
        raise DatasetError(
            f"images must have shape (N, H, W) or (N, 1, H, W), got {tuple(x.shape)}."
        )
    if y.dim() != 1:
        raise DatasetError(f"labels must have shape (N,), got {tuple(y.shape)}.")
    if len(x) != len(y):
        raise DatasetError(f"{len(x)} images but {len(y)} labels; the counts must match.")
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(
        TensorDataset(x, y),
        batch_size=batch_size,
        shuffle=shuffle,
        generator=generator,
        drop_last=drop_last,
    )
