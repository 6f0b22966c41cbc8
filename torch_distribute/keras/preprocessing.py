"""``image_dataset_from_directory``: batches of images from ``class_a/ class_b/`` folders.

Like ``keras.utils.image_dataset_from_directory``, with PyTorch's layout: images are
``float32`` tensors ``(N, C, H, W)`` with values in ``[0, 255]``, labels ``int64`` (or
one-hot / binary floats). The result is an iterable of *global* batches that ``fit``,
``evaluate`` and ``experimental_distribute_dataset`` take as they are. Needs Pillow.

>>> import torch_distribute as td
>>> # train, val = td.keras.preprocessing.image_dataset_from_directory(
>>> #     "cats_and_dogs/", image_size=(160, 160), batch_size=32,
>>> #     validation_split=0.2, subset="both", seed=123)
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from torch_distribute.errors import DatasetError, InvalidArgumentError

__all__ = ["ImageDataset", "image_dataset_from_directory"]

IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png", ".bmp", ".gif")
_CHANNELS = {"rgb": ("RGB", 3), "grayscale": ("L", 1), "rgba": ("RGBA", 4)}


def _resample(interpolation: str) -> Any:
    from PIL import Image

    methods = {"bilinear": Image.Resampling.BILINEAR, "nearest": Image.Resampling.NEAREST,
               "bicubic": Image.Resampling.BICUBIC, "lanczos": Image.Resampling.LANCZOS,
               "area": Image.Resampling.BOX}
    if interpolation not in methods:
        raise InvalidArgumentError(f"interpolation must be one of {sorted(methods)}, got {interpolation!r}.")
    return methods[interpolation]


class ImageDataset:
    """Batches ``(images, labels)`` read from image files (reshuffled every pass when ``shuffle``).

    ``generator`` decides the order (``BackupAndRestore`` saves it); ``cache()`` keeps the
    decoded images in memory after the first pass.
    """

    def __init__(self, file_paths: list[str], labels: np.ndarray | None, class_names: list[str], batch_size: int,
                 image_size: tuple[int, int], color_mode: str, label_mode: str | None, shuffle: bool, seed: int,
                 interpolation: str):
        self.file_paths = file_paths
        self.class_names = class_names
        self.batch_size = batch_size
        self.image_size = image_size
        self.label_mode = label_mode
        self.shuffle = shuffle
        self.generator = torch.Generator().manual_seed(seed)
        self._labels = labels
        self._mode, self._channels = _CHANNELS[color_mode]
        self._resample = _resample(interpolation)
        self._cache: dict[int, torch.Tensor] | None = None

    def cache(self) -> ImageDataset:
        """Keep decoded images in memory (like ``tf.data.Dataset.cache()``); returns ``self``."""
        self._cache = {}
        return self

    def __len__(self) -> int:
        return -(-len(self.file_paths) // self.batch_size)

    def _image(self, index: int) -> torch.Tensor:
        if self._cache is not None and index in self._cache:
            return self._cache[index]
        from PIL import Image

        with Image.open(self.file_paths[index]) as image:
            image = image.convert(self._mode).resize((self.image_size[1], self.image_size[0]), self._resample)
            array = np.asarray(image, dtype=np.float32).reshape(self.image_size[0], self.image_size[1], self._channels)
        tensor = torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()
        if self._cache is not None:
            self._cache[index] = tensor
        return tensor

    def _targets(self, all_labels: np.ndarray, indices: torch.Tensor) -> torch.Tensor:
        labels = torch.from_numpy(all_labels[indices.numpy()]).long()
        if self.label_mode == "categorical":
            return torch.nn.functional.one_hot(labels, len(self.class_names)).float()
        if self.label_mode == "binary":
            return labels.float().unsqueeze(-1)
        return labels

    def __iter__(self) -> Iterator[Any]:
        count = len(self.file_paths)
        order = torch.randperm(count, generator=self.generator) if self.shuffle else torch.arange(count)
        for start in range(0, count, self.batch_size):
            indices = order[start:start + self.batch_size]
            images = torch.stack([self._image(int(i)) for i in indices])
            if self.label_mode is None or self._labels is None:
                yield images
            else:
                yield images, self._targets(self._labels, indices)

    def __repr__(self) -> str:
        return (f"ImageDataset({len(self.file_paths)} files, classes={self.class_names}, "
                f"batch_size={self.batch_size}, image_size={self.image_size})")


def _list_files(directory: str, class_names: Sequence[str] | None, follow_links: bool) -> tuple[list[str], list[int], list[str]]:
    found = sorted(d for d in os.listdir(directory) if os.path.isdir(os.path.join(directory, d)))
    if class_names is not None:
        missing = sorted(set(class_names) - set(found))
        if missing:
            raise InvalidArgumentError(f"class_names {missing} are not folders of {directory!r} (folders: {found}).")
        found = list(class_names)
    paths: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(found):
        for root, _, files in sorted(os.walk(os.path.join(directory, name), followlinks=follow_links)):
            for file in sorted(files):
                if file.lower().endswith(IMAGE_EXTENSIONS):
                    paths.append(os.path.join(root, file))
                    labels.append(label)
    return paths, labels, found


def image_dataset_from_directory(
    directory: str | os.PathLike[str],
    labels: str | Sequence[int] | None = "inferred",
    label_mode: str | None = "int",
    class_names: Sequence[str] | None = None,
    color_mode: str = "rgb",
    batch_size: int = 32,
    image_size: tuple[int, int] = (256, 256),
    shuffle: bool = True,
    seed: int | None = None,
    validation_split: float | None = None,
    subset: str | None = None,
    interpolation: str = "bilinear",
    follow_links: bool = False,
) -> ImageDataset | tuple[ImageDataset, ImageDataset]:
    """Image batches from ``directory/<class>/*.jpg`` (Keras' arguments and behaviour).

    Class ids follow the sorted folder names (or ``class_names``). The file list is
    shuffled once with ``seed`` before ``validation_split`` takes the last part for
    ``subset="validation"`` (``"training"`` the rest, ``"both"`` returns both), so use the
    same ``seed`` for both calls. With ``seed=None`` it is drawn from the torch RNG: every
    worker of a multi-worker job must give the same seed (or call ``torch.manual_seed``).
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise InvalidArgumentError(f"image_dataset_from_directory: {directory!r} is not a directory.")
    if color_mode not in _CHANNELS:
        raise InvalidArgumentError(f"color_mode must be one of {sorted(_CHANNELS)}, got {color_mode!r}.")
    if label_mode not in ("int", "categorical", "binary", None):
        raise InvalidArgumentError(f"label_mode must be 'int', 'categorical', 'binary' or None, got {label_mode!r}.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be a positive int, got {batch_size!r}.")
    if subset not in (None, "training", "validation", "both"):
        raise InvalidArgumentError(f"subset must be 'training', 'validation', 'both' or None, got {subset!r}.")
    if (validation_split is None) != (subset is None):
        raise InvalidArgumentError("validation_split and subset go together: give both or neither.")
    if validation_split is not None and not 0 < validation_split < 1:
        raise InvalidArgumentError(f"validation_split must be in (0, 1), got {validation_split}.")
    paths, inferred, names = _list_files(directory, class_names, follow_links)
    if isinstance(labels, str):
        if labels != "inferred":
            raise InvalidArgumentError(f"labels must be 'inferred', None or a list of ints, got {labels!r}.")
        label_list = inferred
    elif labels is None:
        label_list, label_mode = None, None
    else:
        label_list = list(labels)
        if len(label_list) != len(paths):
            raise InvalidArgumentError(f"labels has {len(label_list)} entries for {len(paths)} image files.")
    if not paths:
        raise DatasetError(f"No images ({', '.join(IMAGE_EXTENSIONS)}) found under {directory!r}.")
    if label_mode == "binary" and len(names) != 2:
        raise InvalidArgumentError(f"label_mode='binary' needs exactly 2 classes, found {len(names)}: {names}.")
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)))
    order = np.random.default_rng(seed).permutation(len(paths)) if shuffle else np.arange(len(paths))
    paths = [paths[i] for i in order]
    label_array = None if label_list is None else np.asarray(label_list, dtype=np.int64)[order]
    size = (int(image_size[0]), int(image_size[1]))

    def make(lo: int, hi: int, offset: int) -> ImageDataset:
        return ImageDataset(paths[lo:hi], None if label_array is None else label_array[lo:hi], names, batch_size,
                            size, color_mode, label_mode, shuffle, seed + offset, interpolation)

    if validation_split is None:
        return make(0, len(paths), 0)
    cut = len(paths) - int(validation_split * len(paths))
    if cut in (0, len(paths)):
        raise InvalidArgumentError(f"validation_split={validation_split} leaves an empty subset of {len(paths)} files.")
    training, validation = make(0, cut, 0), make(cut, len(paths), 1)
    if subset == "both":
        return training, validation
    return training if subset == "training" else validation
