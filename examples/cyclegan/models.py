"""CycleGAN's networks: ResNet generators and PatchGAN discriminators, sizes configurable.

The generator is the paper's (Zhu et al. 2017, Johnson et al. 2016): reflection padding,
7x7 stem, two stride-2 downsamplings, residual blocks, two transposed-conv upsamplings,
7x7 head with tanh. The discriminator is the 70x70 PatchGAN at ``layers=3``: one real/fake
logit per overlapping patch. Instance normalization everywhere (not batch norm: it does not
depend on the other samples of the batch, so 1 or N replicas compute the same thing).

>>> config = ModelConfig(image_size=32, generator_filters=8, residual_blocks=1,
...                      discriminator_filters=8, discriminator_layers=2)
>>> generator, discriminator = make_generator(config), make_discriminator(config)
>>> x = torch.zeros(2, 3, 32, 32)
>>> tuple(generator(x).shape), tuple(discriminator(x).shape)
((2, 3, 32, 32), (2, 1, 6, 6))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "ModelConfig",
    "PatchDiscriminator",
    "ResidualBlock",
    "ResnetGenerator",
    "init_weights",
    "make_discriminator",
    "make_generator",
]

DOWNSAMPLINGS = 2  # the generator halves the resolution twice, then doubles it twice


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the four networks. The paper's 256x256 setting is
    ``ModelConfig(256, 64, 9, 64, 3)``; the CPU default is much smaller.

    >>> ModelConfig(image_size=30).validate()
    Traceback (most recent call last):
    ...
    ValueError: --image-size 30 must be a multiple of 4 (the generator downsamples twice by 2).
    """

    image_size: int = 32
    generator_filters: int = 16
    residual_blocks: int = 3
    discriminator_filters: int = 16
    discriminator_layers: int = 3
    channels: int = 3

    def validate(self) -> ModelConfig:
        """Raise ``ValueError`` naming the option to change when the sizes do not fit."""
        factor = 2**DOWNSAMPLINGS
        if self.image_size < factor or self.image_size % factor:
            raise ValueError(
                f"--image-size {self.image_size} must be a multiple of {factor} (the generator "
                f"downsamples twice by 2)."
            )
        for name in ("generator_filters", "discriminator_filters", "discriminator_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}.")
        if self.residual_blocks < 0:
            raise ValueError(f"--residual-blocks must be >= 0, got {self.residual_blocks}.")
        if patch_grid_size(self.image_size, self.discriminator_layers) < 1:
            raise ValueError(
                f"A PatchGAN discriminator with --discriminator-layers "
                f"{self.discriminator_layers} leaves no patch of a {self.image_size}x"
                f"{self.image_size} image; use fewer layers or a larger --image-size."
            )
        return self


def patch_grid_size(image_size: int, layers: int) -> int:
    """Side of the discriminator's output grid: ``layers`` stride-2 convs, then two stride-1.

    >>> patch_grid_size(256, 3), patch_grid_size(32, 3), patch_grid_size(16, 3)
    (30, 2, 0)
    """
    size = image_size
    for _ in range(layers):
        size = (size + 2 - 4) // 2 + 1
    for _ in range(2):
        size = size + 2 - 4 + 1
    return size


def _norm(channels: int) -> nn.Module:
    # Learned scale and offset, as the TF tutorial's InstanceNormalization; no running stats.
    return nn.InstanceNorm2d(channels, affine=True, track_running_stats=False)


class ResidualBlock(nn.Module):
    """``x + (pad-conv3x3-norm-relu-pad-conv3x3-norm)(x)``.

    >>> tuple(ResidualBlock(4)(torch.zeros(1, 4, 8, 8)).shape)
    (1, 4, 8, 8)
    """

    def __init__(self, channels: int):
        super().__init__()
        # No conv bias before an instance norm: the norm subtracts it again. (Its gradient
        # would be rounding noise, which Adam blows up to lr-sized steps.)
        self.body = nn.Sequential(
            nn.ReflectionPad2d(1), nn.Conv2d(channels, channels, 3, bias=False), _norm(channels),
            nn.ReLU(inplace=True),
            nn.ReflectionPad2d(1), nn.Conv2d(channels, channels, 3, bias=False), _norm(channels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class ResnetGenerator(nn.Module):
    """Image to image of the same size, output in ``[-1, 1]``.

    >>> g = ResnetGenerator(channels=3, filters=8, residual_blocks=1)
    >>> tuple(g(torch.zeros(1, 3, 16, 16)).shape)
    (1, 3, 16, 16)
    """

    def __init__(self, channels: int = 3, filters: int = 64, residual_blocks: int = 9):
        super().__init__()
        layers: list[nn.Module] = [
            nn.ReflectionPad2d(3), nn.Conv2d(channels, filters, 7, bias=False), _norm(filters),
            nn.ReLU(inplace=True),
        ]
        width = filters
        for _ in range(DOWNSAMPLINGS):
            layers += [nn.Conv2d(width, width * 2, 3, stride=2, padding=1, bias=False),
                       _norm(width * 2), nn.ReLU(inplace=True)]
            width *= 2
        layers += [ResidualBlock(width) for _ in range(residual_blocks)]
        for _ in range(DOWNSAMPLINGS):
            layers += [nn.ConvTranspose2d(width, width // 2, 3, stride=2, padding=1,
                                          output_padding=1, bias=False),
                       _norm(width // 2), nn.ReLU(inplace=True)]
            width //= 2
        layers += [nn.ReflectionPad2d(3), nn.Conv2d(width, channels, 7), nn.Tanh()]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class PatchDiscriminator(nn.Module):
    """Image to a grid of real/fake logits ``(N, 1, P, P)``, one per receptive-field patch.

    >>> d = PatchDiscriminator(channels=3, filters=8, layers=3)
    >>> tuple(d(torch.zeros(1, 3, 32, 32)).shape)
    (1, 1, 2, 2)
    """

    def __init__(self, channels: int = 3, filters: int = 64, layers: int = 3):
        super().__init__()
        blocks: list[nn.Module] = [nn.Conv2d(channels, filters, 4, stride=2, padding=1),
                                   nn.LeakyReLU(0.2, inplace=True)]
        width = filters
        for n in range(1, layers):
            out = filters * min(2**n, 8)
            blocks += [nn.Conv2d(width, out, 4, stride=2, padding=1, bias=False), _norm(out),
                       nn.LeakyReLU(0.2, inplace=True)]
            width = out
        out = filters * min(2**layers, 8)
        blocks += [nn.Conv2d(width, out, 4, stride=1, padding=1, bias=False), _norm(out),
                   nn.LeakyReLU(0.2, inplace=True),
                   nn.Conv2d(out, 1, 4, stride=1, padding=1)]
        self.net = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def init_weights(module: nn.Module, std: float = 0.02) -> nn.Module:
    """The paper's initialization: conv weights ~ N(0, std), norm scales ~ N(1, std), biases 0.

    >>> layer = init_weights(nn.Conv2d(1, 1, 3))
    >>> float(layer.bias.detach().abs().sum())
    0.0
    """
    for m in module.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
            nn.init.normal_(m.weight, 0.0, std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.InstanceNorm2d) and m.affine:
            nn.init.normal_(m.weight, 1.0, std)
            nn.init.zeros_(m.bias)
    return module


def make_generator(config: ModelConfig) -> ResnetGenerator:
    """A freshly initialized generator (uses the global torch RNG: seed it first).

    >>> make_generator(ModelConfig(image_size=16, generator_filters=4, residual_blocks=1)).training
    True
    """
    return init_weights(ResnetGenerator(config.channels, config.generator_filters,
                                        config.residual_blocks))


def make_discriminator(config: ModelConfig) -> PatchDiscriminator:
    """A freshly initialized PatchGAN discriminator (uses the global torch RNG).

    >>> d = make_discriminator(ModelConfig(image_size=32, discriminator_filters=4))
    >>> sum(p.numel() for p in d.parameters()) > 0
    True
    """
    return init_weights(PatchDiscriminator(config.channels, config.discriminator_filters,
                                           config.discriminator_layers))
