"""MobileNetV2 (Sandler et al., 2018) in PyTorch, with ``keras.applications``' arguments.

Inverted residual blocks with linear bottlenecks; ``alpha`` scales every layer's width
(rounded to a multiple of 8, as Keras does); BatchNorm with Keras' ``momentum=0.999`` and
``epsilon=1e-3``. Inputs are channels-first ``(N, 3, H, W)`` (PyTorch's layout); any size
of at least 32x32 works. No pretrained weights: nothing is downloaded.

>>> import torch, torch_distribute as td
>>> model = td.keras.applications.MobileNetV2(input_shape=(3, 32, 32), alpha=0.35, classes=2, weights=None)
>>> model(torch.zeros(2, 3, 32, 32)).shape
torch.Size([2, 2])
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from torch_distribute.errors import InvalidArgumentError

__all__ = ["MobileNetV2", "preprocess_input"]

# (expansion t, output channels c, repeats n, first stride s) of the paper's Table 2.
_BLOCKS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


def _make_divisible(value: float, divisor: int = 8) -> int:
    """Keras' rounding of channel counts: nearest multiple of ``divisor``, never 10% below."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def _bn(channels: int, momentum: float) -> nn.BatchNorm2d:
    # Keras' momentum m keeps m of the old statistics; torch's momentum is the new share.
    return nn.BatchNorm2d(channels, eps=1e-3, momentum=1.0 - momentum)


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, relu: bool = True,
             momentum: float = 0.999) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
                               _bn(cout, momentum)]
    if relu:
        layers.append(nn.ReLU6(inplace=True))
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """Expand (1x1), depthwise 3x3, project (1x1, linear); a shortcut when shapes allow."""

    def __init__(self, cin: int, cout: int, stride: int, expansion: int, momentum: float = 0.999):
        super().__init__()
        hidden = cin * expansion
        layers: list[nn.Module] = []
        if expansion != 1:
            layers.append(_conv_bn(cin, hidden, 1, momentum=momentum))
        layers += [_conv_bn(hidden, hidden, 3, stride, groups=hidden, momentum=momentum),
                   _conv_bn(hidden, cout, 1, relu=False, momentum=momentum)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return x + out if self.residual else out


class MobileNetV2(nn.Module):
    """``keras.applications.MobileNetV2`` for PyTorch (``weights=None`` or a state-dict file).

    ``include_top``: global average pooling and a ``Dense(classes)`` with
    ``classifier_activation`` (``"softmax"``, as in Keras, or ``None`` for logits).
    Without the top, ``pooling`` is ``None`` (feature maps), ``"avg"`` or ``"max"``.
    ``dropout`` before the classifier (Keras has none: 0.0). ``batch_norm_momentum`` in
    Keras' sense (the share of the old moving statistics kept, 0.999); lower it (0.9) for
    short trainings from scratch, whose moving statistics would otherwise lag far behind.
    """

    def __init__(self, input_shape: Sequence[int] | None = None, alpha: float = 1.0, include_top: bool = True,
                 weights: str | os.PathLike[str] | None = None, pooling: str | None = None, classes: int = 1000,
                 classifier_activation: str | None = "softmax", dropout: float = 0.0,
                 batch_norm_momentum: float = 0.999):
        super().__init__()
        if input_shape is not None:
            if len(input_shape) != 3 or input_shape[0] != 3:
                raise InvalidArgumentError(
                    f"input_shape is channels-first (3, H, W) in PyTorch, got {tuple(input_shape)}.")
            if min(input_shape[1:]) < 32:
                raise InvalidArgumentError(f"MobileNetV2 needs images of at least 32x32, got {tuple(input_shape)}.")
        if alpha <= 0:
            raise InvalidArgumentError(f"alpha (the width multiplier) must be > 0, got {alpha}.")
        if weights == "imagenet":
            raise InvalidArgumentError(
                "weights='imagenet' would need a download; this MobileNetV2 is trained from scratch "
                "(weights=None) or loads a state-dict file you give (weights='path/to/file.pt').")
        if classifier_activation not in ("softmax", None, "linear"):
            raise InvalidArgumentError(f"classifier_activation must be 'softmax' or None, got {classifier_activation!r}.")
        if pooling not in (None, "avg", "max"):
            raise InvalidArgumentError(f"pooling must be None, 'avg' or 'max', got {pooling!r}.")
        self.alpha = alpha
        channels = _make_divisible(32 * alpha)
        m = batch_norm_momentum
        layers: list[nn.Module] = [_conv_bn(3, channels, 3, stride=2, momentum=m)]
        for expansion, c, repeats, stride in _BLOCKS:
            out = _make_divisible(c * alpha)
            for i in range(repeats):
                layers.append(InvertedResidual(channels, out, stride if i == 0 else 1, expansion, m))
                channels = out
        last = _make_divisible(1280 * alpha) if alpha > 1.0 else 1280
        layers.append(_conv_bn(channels, last, 1, momentum=m))
        self.features = nn.Sequential(*layers)
        self.include_top = include_top
        self.pooling = "avg" if include_top else pooling
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.classifier = nn.Linear(last, classes) if include_top else None
        self.softmax = include_top and classifier_activation == "softmax"
        self._init_weights()
        if weights is not None:
            self.load_state_dict(torch.load(os.fspath(weights), map_location="cpu", weights_only=True))

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0, 0.01)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        if self.pooling == "avg":
            x = x.mean((2, 3))
        elif self.pooling == "max":
            x = x.amax((2, 3))
        if self.classifier is None:
            return x
        x = self.classifier(self.dropout(x))
        return torch.softmax(x, dim=-1) if self.softmax else x


def preprocess_input(images: torch.Tensor) -> torch.Tensor:
    """Keras' MobileNetV2 preprocessing: pixels in [0, 255] to [-1, 1]."""
    return images.float() / 127.5 - 1.0
