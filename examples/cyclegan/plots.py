"""Figures: the translation grid the tutorial plots, and loss curves. Headless (Agg).

>>> x = torch.zeros(2, 3, 8, 8)
>>> figure = translation_figure({"X": x, "G(X)": x, "F(G(X))": x})
>>> len(figure.axes)
6
>>> plt.close(figure)
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # no display: figures go to PNG files and TensorBoard
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from examples.cyclegan.steps import CycleGAN  # noqa: E402

__all__ = ["loss_curves_figure", "save_figure", "translate", "translation_figure"]


def translate(gan: CycleGAN, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """``x -> G(x) -> F(G(x))`` and ``y -> F(y) -> G(F(y))``, on the CPU, in column order.

    Call it outside ``strategy.run``: it uses the networks' own weights (replica 0's copy).

    >>> from examples.cyclegan.models import ModelConfig
    >>> from examples.cyclegan.steps import build_cyclegan
    >>> gan = build_cyclegan(ModelConfig(16, 2, 0, 2, 2))
    >>> list(translate(gan, torch.zeros(1, 3, 16, 16), torch.zeros(1, 3, 16, 16)))
    ['X', 'G(X)', 'F(G(X))', 'Y', 'F(Y)', 'G(F(Y))']
    """
    device = next(gan.generator_g.parameters()).device
    x, y = x.to(device), y.to(device)
    with torch.no_grad():
        g_x, f_y = gan.generator_g(x), gan.generator_f(y)
        columns = {"X": x, "G(X)": g_x, "F(G(X))": gan.generator_f(g_x),
                   "Y": y, "F(Y)": f_y, "G(F(Y))": gan.generator_g(f_y)}
    return {name: images.detach().cpu() for name, images in columns.items()}


def _as_rgb(image: torch.Tensor) -> np.ndarray:
    """``(3, H, W)`` in [-1, 1] -> ``(H, W, 3)`` in [0, 1] for ``imshow``."""
    return ((image.float().clamp(-1, 1) + 1) / 2).permute(1, 2, 0).numpy()


def translation_figure(columns: Mapping[str, torch.Tensor], title: str | None = None) -> Figure:
    """A grid: one row per image, one column per entry of ``columns`` (``(N, 3, H, W)`` each).

    >>> figure = translation_figure({"X": torch.zeros(1, 3, 4, 4)}, title="epoch 1")
    >>> figure.get_suptitle()
    'epoch 1'
    >>> plt.close(figure)
    """
    names = list(columns)
    rows = len(columns[names[0]])
    figure, axes = plt.subplots(rows, len(names), figsize=(1.6 * len(names), 1.6 * rows + 0.4),
                                squeeze=False)
    for col, name in enumerate(names):
        for row in range(rows):
            ax = axes[row][col]
            ax.imshow(_as_rgb(columns[name][row]), interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if row == 0:
                ax.set_title(name, fontsize=10)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    return figure


def loss_curves_figure(runs: Mapping[str, Sequence[Mapping[str, float]]], keys: Sequence[str],
                       xlabel: str = "step", title: str | None = None) -> Figure:
    """One panel per loss in ``keys``; in each, one curve per run (``{label: [values per x]}``).

    >>> figure = loss_curves_figure({"a": [{"l": 1.0}, {"l": 0.5}]}, keys=["l"])
    >>> len(figure.axes)
    1
    >>> plt.close(figure)
    """
    columns = min(len(keys), 4)
    rows = -(-len(keys) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4 * columns, 3 * rows), squeeze=False)
    styles = ["-", "--", ":", "-."]
    for i, key in enumerate(keys):
        ax = axes[i // columns][i % columns]
        for j, (label, history) in enumerate(runs.items()):
            values = [entry[key] for entry in history]
            ax.plot(range(1, len(values) + 1), values, styles[j % len(styles)], label=label,
                    linewidth=1.2)
        ax.set_title(key)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend()
    for i in range(len(keys), rows * columns):
        axes[i // columns][i % columns].axis("off")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    return figure


def save_figure(figure: Figure, path: str | os.PathLike[str], close: bool = True) -> str:
    """Write ``figure`` as a PNG (creating the folder) and return the path.

    >>> import tempfile
    >>> path = save_figure(plt.figure(), os.path.join(tempfile.mkdtemp(), "a", "f.png"))
    >>> os.path.isfile(path)
    True
    """
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.savefig(path, dpi=100)
    if close:
        plt.close(figure)
    return path
