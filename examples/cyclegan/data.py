"""The two image domains X and Y, unpaired, as loaders of *global* batches.

Two sources, both giving uint8 images ``(3, S, S)`` that :class:`UnpairedImages` scales to
``[-1, 1]``:

* the standard CycleGAN folder layout (``trainA/ trainB/ testA/ testB/``, as in
  horse2zebra), read lazily with PIL and resized to ``S x S``;
* with no folder, :func:`digits_domains`: scikit-learn's bundled handwritten digits drawn
  two ways (X: thin white strokes on black; Y: thick orange strokes on blue diagonal
  stripes), deterministic and download-free.

Determinism is what makes 1 and N replicas comparable: the shuffle of epoch ``e`` and the
jitter of sample ``i`` come from generators seeded with ``(seed, e, i)``, never from global
RNG state, so every strategy, worker and loader worker sees the same global batches.

>>> domains = digits_domains(image_size=32)
>>> train = UnpairedImages(domains.train_x, domains.train_y, train=True, seed=0)
>>> x, y = train[0]
>>> tuple(x.shape), x.dtype, float(x.min()) >= -1.0
((3, 32, 32), torch.float32, True)
>>> loader = make_loader(train, global_batch_size=16, train=True)
>>> tuple(next(iter(loader))[0].shape)
(16, 3, 32, 32)
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

__all__ = [
    "IMAGE_EXTENSIONS",
    "SPLIT_FOLDERS",
    "DomainImages",
    "Domains",
    "ImageFiles",
    "TensorImages",
    "UnpairedImages",
    "digits_domains",
    "folder_domains",
    "global_batch_sizes",
    "load_domains",
    "make_loader",
    "plot_batch",
    "random_jitter",
]

SPLIT_FOLDERS = ("trainA", "trainB", "testA", "testB")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
JITTER_SCALE = 286 / 256  # the tutorial resizes 256 -> 286, then crops 256 back


class DomainImages(Dataset):
    """One domain: ``images[i]`` is a uint8 tensor ``(3, S, S)``."""

    image_size: int

    def __len__(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def __getitem__(self, index: int) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


class TensorImages(DomainImages):
    """A domain held in memory: a uint8 tensor ``(N, 3, S, S)``.

    >>> TensorImages(torch.zeros(4, 3, 8, 8, dtype=torch.uint8))[0].shape
    torch.Size([3, 8, 8])
    """

    def __init__(self, images: torch.Tensor):
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(
                f"TensorImages needs uint8 images of shape (N, 3, S, S), got {images.dtype} "
                f"{tuple(images.shape)}."
            )
        if images.shape[2] != images.shape[3]:
            raise ValueError(f"TensorImages needs square images, got {tuple(images.shape[2:])}.")
        self.images = images
        self.image_size = int(images.shape[2])

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.images[index]


class ImageFiles(DomainImages):
    """A domain read lazily from image files, converted to RGB and resized to ``S x S``.

    >>> ImageFiles(["a.png"], image_size=64).image_size
    64
    """

    def __init__(self, paths: Sequence[str], image_size: int):
        self.paths = list(paths)
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        from PIL import Image

        with Image.open(self.paths[index]) as image:
            rgb = image.convert("RGB")
            if rgb.size != (self.image_size, self.image_size):
                rgb = rgb.resize((self.image_size, self.image_size), Image.Resampling.BICUBIC)
            array = np.asarray(rgb, dtype=np.uint8)
        return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


@dataclass(frozen=True)
class Domains:
    """Train and test images of both domains, and where they came from."""

    train_x: DomainImages
    train_y: DomainImages
    test_x: DomainImages
    test_y: DomainImages
    description: str


# -- sources ---------------------------------------------------------------------------------
def folder_domains(data_dir: str | os.PathLike[str], image_size: int) -> Domains:
    """Read the CycleGAN layout: ``data_dir/{trainA,trainB,testA,testB}/*.{png,jpg,...}``.

    ``A`` is domain X (horses), ``B`` domain Y (zebras). Raises ``FileNotFoundError`` naming
    what is missing when a folder is absent or holds no image file.

    >>> domains = folder_domains("~/datasets/horse2zebra", image_size=256)  # doctest: +SKIP
    >>> len(domains.train_x), len(domains.train_y)  # doctest: +SKIP
    (1067, 1334)
    """
    root = os.path.expanduser(os.fspath(data_dir))
    if not os.path.isdir(root):
        raise FileNotFoundError(
            f"--data-dir {root!r} does not exist; it must hold the CycleGAN folders "
            f"{', '.join(SPLIT_FOLDERS)} (as horse2zebra does)."
        )
    missing = [name for name in SPLIT_FOLDERS if not os.path.isdir(os.path.join(root, name))]
    if missing:
        raise FileNotFoundError(
            f"--data-dir {root!r} lacks the folder(s) {', '.join(missing)}: a CycleGAN dataset "
            f"has {', '.join(SPLIT_FOLDERS)} (A = domain X, B = domain Y), each with image files."
        )
    splits = {}
    for name in SPLIT_FOLDERS:
        folder = os.path.join(root, name)
        paths = sorted(
            os.path.join(folder, f) for f in os.listdir(folder)
            if f.lower().endswith(IMAGE_EXTENSIONS) and not f.startswith(".")
        )
        if not paths:
            raise FileNotFoundError(
                f"{folder!r} holds no image file (looked for {', '.join(IMAGE_EXTENSIONS)})."
            )
        splits[name] = ImageFiles(paths, image_size)
    sizes = "/".join(str(len(splits[name])) for name in SPLIT_FOLDERS)
    return Domains(
        splits["trainA"], splits["trainB"], splits["testA"], splits["testB"],
        f"CycleGAN folders in {root} (trainA/trainB/testA/testB: {sizes} images, "
        f"resized to {image_size}x{image_size})",
    )


def _stripes(image_size: int) -> torch.Tensor:
    """Domain Y's background: blue diagonal stripes, 4 periods across the image."""
    coords = torch.arange(image_size, dtype=torch.float32)
    diagonal = (coords[:, None] + coords[None, :]) / image_size
    wave = 0.5 + 0.5 * torch.sin(2 * math.pi * 4 * diagonal)
    dark, light = torch.tensor([0.05, 0.10, 0.35]), torch.tensor([0.20, 0.45, 0.85])
    return dark[:, None, None] + (light - dark)[:, None, None] * wave


def _render_digits(strokes: torch.Tensor, image_size: int, domain: str) -> torch.Tensor:
    """``strokes`` ``(N, 1, 8, 8)`` in [0, 1] -> uint8 ``(N, 3, S, S)`` in the domain's style."""
    mask = F.interpolate(strokes, size=(image_size, image_size), mode="bilinear",
                         align_corners=False).clamp(0.0, 1.0)
    if domain == "x":
        rgb = mask.expand(-1, 3, -1, -1)
    else:
        # Thicker strokes: a max-filter a sixteenth of the image wide, then a soft edge.
        radius = max(1, image_size // 32)
        thick = F.max_pool2d(mask, kernel_size=2 * radius + 1, stride=1, padding=radius)
        thick = F.avg_pool2d(thick, kernel_size=3, stride=1, padding=1, count_include_pad=False)
        orange = torch.tensor([1.0, 0.6, 0.1])[None, :, None, None]
        rgb = thick * orange + (1.0 - thick) * _stripes(image_size)[None]
    return (rgb * 255.0).round().clamp(0, 255).to(torch.uint8)


def digits_domains(image_size: int = 32, test_fraction: float = 0.1, seed: int = 0) -> Domains:
    """scikit-learn's 1797 bundled digits as two unpaired domains; no download.

    The digits are shuffled with ``seed`` and split in two disjoint halves, so no image of X
    has its counterpart in Y (unpaired, as horses and zebras). X draws its half as white
    strokes on black; Y draws the other half with thicker strokes, in
    orange, on blue diagonal stripes. ``test_fraction`` of each half is held out.

    >>> domains = digits_domains(image_size=32)
    >>> len(domains.train_x), len(domains.train_y), len(domains.test_x), len(domains.test_y)
    (809, 808, 90, 90)
    """
    if image_size < 8:
        raise ValueError(f"image_size must be at least 8 for the digits, got {image_size}.")
    from sklearn.datasets import load_digits

    digits = torch.as_tensor(np.asarray(load_digits().images), dtype=torch.float32) / 16.0
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(digits)))
    halves = {"x": order[: len(order) // 2 + 1], "y": order[len(order) // 2 + 1:]}
    splits: dict[str, TensorImages] = {}
    for domain, indices in halves.items():
        images = _render_digits(digits[indices].unsqueeze(1), image_size, domain)
        n_test = max(1, round(len(images) * test_fraction))
        splits[f"train_{domain}"] = TensorImages(images[n_test:])
        splits[f"test_{domain}"] = TensorImages(images[:n_test])
    return Domains(
        splits["train_x"], splits["train_y"], splits["test_x"], splits["test_y"],
        f"scikit-learn digits at {image_size}x{image_size}: X white on black, Y thick orange on "
        f"blue stripes ({len(splits['train_x'])}/{len(splits['train_y'])} train, "
        f"{len(splits['test_x'])}/{len(splits['test_y'])} test images)",
    )


def load_domains(data_dir: str | os.PathLike[str] | None, image_size: int) -> Domains:
    """:func:`folder_domains` when ``data_dir`` is given, else :func:`digits_domains`.

    >>> load_domains(None, 32).description.startswith("scikit-learn digits")
    True
    """
    if data_dir is None:
        return digits_domains(image_size)
    return folder_domains(data_dir, image_size)


# -- the unpaired dataset --------------------------------------------------------------------
def _generator(*seeds: int) -> torch.Generator:
    # A stable mix of the integers (Python's hash() of ints would do too, but this is explicit).
    value = 0
    for s in seeds:
        value = (value * 1_000_003 + int(s) + 1) % (2**63 - 1)
    return torch.Generator().manual_seed(value)


def _to_unit_range(image: torch.Tensor) -> torch.Tensor:
    # The default dtype: float32, or float64 when a run asks for it (see train's --dtype).
    return image.to(torch.get_default_dtype()) / 127.5 - 1.0


def random_jitter(image: torch.Tensor, generator: torch.Generator,
                  scale: float = JITTER_SCALE) -> torch.Tensor:
    """Resize up by ``scale`` (nearest neighbour), crop back at random, mirror half the time.

    >>> out = random_jitter(torch.zeros(3, 32, 32), torch.Generator().manual_seed(0))
    >>> tuple(out.shape)
    (3, 32, 32)
    """
    size = image.shape[-1]
    large = max(size, round(size * scale))
    resized = F.interpolate(image[None], size=(large, large), mode="nearest")[0]
    top, left = (int(v) for v in torch.randint(0, large - size + 1, (2,), generator=generator))
    cropped = resized[:, top:top + size, left:left + size]
    if bool(torch.rand((), generator=generator) < 0.5):
        cropped = cropped.flip(-1)
    return cropped


class UnpairedImages(Dataset):
    """Pairs ``(x, y)`` of float images in ``[-1, 1]`` from two domains of different sizes.

    The domains are trimmed to the same length ``min(len(X), len(Y))`` before they are zipped:
    then an epoch has a fixed number of global batches on every replica and worker (zipping
    two datasets of different lengths stops at the shorter, a silent surprise otherwise).
    Training (``train=True``): each epoch (:meth:`set_epoch`) draws an independent random
    ``n``-subset and order of each domain, and each image gets :func:`random_jitter`.
    Test: the first ``n`` images of each domain in file order, unchanged.

    >>> domains = digits_domains(image_size=16)
    >>> data = UnpairedImages(domains.test_x, domains.test_y, train=False)
    >>> len(data)
    90
    """

    def __init__(self, domain_x: DomainImages, domain_y: DomainImages, train: bool,
                 seed: int = 0, jitter_scale: float = JITTER_SCALE):
        if len(domain_x) == 0 or len(domain_y) == 0:
            raise ValueError(
                f"Both domains need images; got {len(domain_x)} in X and {len(domain_y)} in Y."
            )
        if domain_x.image_size != domain_y.image_size:
            raise ValueError(
                f"The domains have different image sizes {domain_x.image_size} and "
                f"{domain_y.image_size}."
            )
        self.domain_x, self.domain_y = domain_x, domain_y
        self.train, self.seed, self.jitter_scale = train, seed, jitter_scale
        self.length = min(len(domain_x), len(domain_y))
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Choose the subset, order and jitter of ``epoch`` (call before iterating it)."""
        self.epoch = epoch
        if not self.train:
            self._order_x = self._order_y = torch.arange(self.length)
            return
        generator = _generator(self.seed, epoch)
        self._order_x = torch.randperm(len(self.domain_x), generator=generator)[: self.length]
        self._order_y = torch.randperm(len(self.domain_y), generator=generator)[: self.length]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = _to_unit_range(self.domain_x[int(self._order_x[index])])
        y = _to_unit_range(self.domain_y[int(self._order_y[index])])
        if self.train:
            generator = _generator(self.seed, self.epoch, index)
            x = random_jitter(x, generator, self.jitter_scale)
            y = random_jitter(y, generator, self.jitter_scale)
        return x, y


def make_loader(dataset: UnpairedImages, global_batch_size: int, train: bool,
                num_workers: int = 0) -> DataLoader:
    """A loader of *global* batches, for ``strategy.experimental_distribute_dataset``.

    Training drops the last partial batch (every step then averages over exactly
    ``global_batch_size`` samples); the order comes from ``dataset.set_epoch``, not from the
    loader, so it is the same in every process.

    >>> domains = digits_domains(image_size=16)
    >>> test = UnpairedImages(domains.test_x, domains.test_y, train=False)
    >>> [len(x) for x, _ in make_loader(test, global_batch_size=32, train=False)]
    [32, 32, 26]
    """
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}.")
    if train and len(dataset) < global_batch_size:
        raise ValueError(
            f"The training set has {len(dataset)} image pairs, fewer than one global batch of "
            f"{global_batch_size}: lower --batch-size-per-replica or use fewer replicas."
        )
    return DataLoader(dataset, batch_size=global_batch_size, shuffle=False, drop_last=train,
                      num_workers=num_workers, persistent_workers=False)


def global_batch_sizes(num_samples: int, global_batch_size: int, drop_last: bool) -> list[int]:
    """The size of every global batch a loader yields (the last one may be smaller).

    >>> global_batch_sizes(10, 4, drop_last=False)
    [4, 4, 2]
    """
    sizes = [min(global_batch_size, num_samples - start)
             for start in range(0, num_samples, global_batch_size)]
    return [s for s in sizes if s == global_batch_size] if drop_last else sizes


def plot_batch(dataset: UnpairedImages, count: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``count`` pairs of a (test) dataset, stacked: the fixed images to plot.

    >>> domains = digits_domains(image_size=16)
    >>> x, y = plot_batch(UnpairedImages(domains.test_x, domains.test_y, train=False))
    >>> tuple(x.shape)
    (5, 3, 16, 16)
    """
    count = min(count, len(dataset))
    pairs = [dataset[i] for i in range(count)]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
