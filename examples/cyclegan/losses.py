"""CycleGAN's losses, every one **per sample**: shape ``(batch,)``, never a batch mean.

A distributed step must not average over its own replica's batch: replicas hold different
numbers of samples (a ragged batch, an empty replica) and their gradients are *summed*. Each
loss here keeps one value per sample; the step turns it into that replica's share of the
global-batch mean with ``td.compute_average_loss(loss, global_batch_size=G)``.

Adversarial losses: ``"lsgan"`` (least squares, the CycleGAN paper) or ``"bce"`` (binary
cross-entropy on logits, the TF tutorial). Both average over the discriminator's patches,
which belong to one sample.

>>> logits = torch.zeros(4, 1, 2, 2)
>>> tuple(generator_loss(logits, "lsgan").shape)
(4,)
>>> cycle_loss(torch.ones(2, 3, 4, 4), torch.zeros(2, 3, 4, 4), lambda_cycle=10.0)
tensor([10., 10.])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "GAN_LOSSES",
    "adversarial_loss",
    "cycle_loss",
    "discriminator_loss",
    "generator_loss",
    "identity_loss",
    "mean_absolute_error",
]

GAN_LOSSES = ("lsgan", "bce")


def _per_sample_mean(values: torch.Tensor) -> torch.Tensor:
    """Mean over every dimension but the first: ``(batch, ...) -> (batch,)``."""
    return values.reshape(values.shape[0], -1).mean(dim=1)


def adversarial_loss(logits: torch.Tensor, target_is_real: bool, gan_loss: str = "lsgan") -> torch.Tensor:
    """How far the discriminator's patch outputs are from "real" (1) or "fake" (0), per sample.

    >>> adversarial_loss(torch.ones(2, 1, 3, 3), target_is_real=True)
    tensor([0., 0.])
    """
    target = torch.ones_like(logits) if target_is_real else torch.zeros_like(logits)
    if gan_loss == "lsgan":
        values = (logits - target).square()
    elif gan_loss == "bce":
        values = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    else:
        raise ValueError(f"gan_loss must be one of {GAN_LOSSES}, got {gan_loss!r}.")
    return _per_sample_mean(values)


def generator_loss(fake_logits: torch.Tensor, gan_loss: str = "lsgan") -> torch.Tensor:
    """The generator wants its fakes judged real.

    >>> generator_loss(torch.zeros(1, 1, 2, 2), "bce")
    tensor([0.6931])
    """
    return adversarial_loss(fake_logits, True, gan_loss)


def discriminator_loss(real_logits: torch.Tensor, fake_logits: torch.Tensor,
                       gan_loss: str = "lsgan") -> torch.Tensor:
    """Half the sum of the real and fake terms (halved, as the paper, to slow D down).

    >>> discriminator_loss(torch.ones(2, 1, 2, 2), torch.zeros(2, 1, 2, 2))
    tensor([0., 0.])
    """
    return 0.5 * (adversarial_loss(real_logits, True, gan_loss)
                  + adversarial_loss(fake_logits, False, gan_loss))


def mean_absolute_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``mean(|a - b|)`` per sample.

    >>> mean_absolute_error(torch.zeros(3, 2), torch.ones(3, 2))
    tensor([1., 1., 1.])
    """
    return _per_sample_mean((a - b).abs())


def cycle_loss(real: torch.Tensor, cycled: torch.Tensor, lambda_cycle: float = 10.0) -> torch.Tensor:
    """``lambda * MAE(real, F(G(real)))``: translating there and back must give the image back.

    >>> cycle_loss(torch.zeros(1, 2), torch.full((1, 2), 0.5), lambda_cycle=10.0)
    tensor([5.])
    """
    return lambda_cycle * mean_absolute_error(real, cycled)


def identity_loss(real: torch.Tensor, same: torch.Tensor, lambda_cycle: float = 10.0) -> torch.Tensor:
    """``0.5 * lambda * MAE(y, G(y))``: G should leave an image already in Y alone.

    >>> identity_loss(torch.zeros(1, 2), torch.ones(1, 2), lambda_cycle=10.0)
    tensor([5.])
    """
    return 0.5 * lambda_cycle * mean_absolute_error(real, same)
