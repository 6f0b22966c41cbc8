"""The four networks with their optimizers, and the per-replica ``train_step``/``test_step``.

Everything here is strategy-agnostic: build the :class:`CycleGAN` inside ``strategy.scope()``
and give the steps to ``strategy.run``. A step returns a dict of scalar losses, each this
replica's share of the global-batch mean, so ``reduce_dict`` (a SUM over replicas) gives the
global values whatever the number of replicas.

>>> import torch_distribute as td
>>> from examples.cyclegan.models import ModelConfig
>>> strategy = td.OneDeviceStrategy("cpu")
>>> with strategy.scope():
...     gan = build_cyclegan(ModelConfig(image_size=16, generator_filters=4, residual_blocks=1,
...                                      discriminator_filters=4, discriminator_layers=2))
>>> train_step = make_train_step(gan, global_batch_size=2)
>>> x = y = torch.zeros(2, 3, 16, 16)
>>> losses = reduce_dict(strategy, strategy.run(train_step, args=(x, y)))
>>> sorted(losses) == sorted(LOSS_KEYS)
True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import torch_distribute as td
from examples.cyclegan.losses import (
    GAN_LOSSES,
    cycle_loss,
    discriminator_loss,
    generator_loss,
    identity_loss,
    mean_absolute_error,
)
from examples.cyclegan.models import ModelConfig, make_discriminator, make_generator

__all__ = [
    "LOSS_KEYS",
    "MAE_KEYS",
    "MAE_LABELS",
    "CycleGAN",
    "build_cyclegan",
    "make_test_step",
    "make_train_step",
    "per_sample_losses",
    "reduce_dict",
]

LOSS_KEYS = (
    "loss_G/loss", "loss_G/cycle", "loss_G/identity", "loss_G/total",
    "loss_F/loss", "loss_F/cycle", "loss_F/identity", "loss_F/total",
    "loss_X/loss", "loss_Y/loss",
)
MAE_LABELS = {
    "MAE/X_cycle": "MAE(X, F(G(X)))",
    "MAE/X_identity": "MAE(X, F(X))",
    "MAE/Y_cycle": "MAE(Y, G(F(Y)))",
    "MAE/Y_identity": "MAE(Y, G(Y))",
}
MAE_KEYS = tuple(MAE_LABELS)

StepFn = Callable[..., dict[str, torch.Tensor]]


@dataclass
class CycleGAN:
    """G: X -> Y, F: Y -> X, D_X judges X, D_Y judges Y; one Adam optimizer each."""

    config: ModelConfig
    generator_g: nn.Module
    generator_f: nn.Module
    discriminator_x: nn.Module
    discriminator_y: nn.Module
    generator_g_optimizer: torch.optim.Optimizer
    generator_f_optimizer: torch.optim.Optimizer
    discriminator_x_optimizer: torch.optim.Optimizer
    discriminator_y_optimizer: torch.optim.Optimizer

    def models(self) -> dict[str, nn.Module]:
        """The four networks by name (also the checkpoint's names)."""
        return {"generator_g": self.generator_g, "generator_f": self.generator_f,
                "discriminator_x": self.discriminator_x, "discriminator_y": self.discriminator_y}

    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        """The optimizers in the order every step applies them: G, F, D_X, D_Y."""
        return (self.generator_g_optimizer, self.generator_f_optimizer,
                self.discriminator_x_optimizer, self.discriminator_y_optimizer)

    def checkpoint(self, **extra: Any) -> td.Checkpoint:
        """One ``td.Checkpoint`` with all eight objects (plus ``extra``, e.g. an epoch counter).

        >>> gan = build_cyclegan(ModelConfig(image_size=16, generator_filters=2,
        ...     residual_blocks=0, discriminator_filters=2, discriminator_layers=2))
        >>> sorted(gan.checkpoint().state_dict()["objects"])[:2]
        ['discriminator_x', 'discriminator_x_optimizer']
        """
        objects: dict[str, Any] = dict(self.models())
        names = ("generator_g", "generator_f", "discriminator_x", "discriminator_y")
        for name, optimizer in zip(names, self.optimizers(), strict=True):
            objects[f"{name}_optimizer"] = optimizer
        return td.Checkpoint(**objects, **extra)


def build_cyclegan(config: ModelConfig, learning_rate: float = 2e-4, beta_1: float = 0.5,
                   fused: bool | None = None) -> CycleGAN:
    """Make the four networks and their Adam optimizers (call it inside ``strategy.scope()``).
    ``fused``: ``torch.optim.Adam``'s (``True``: one fused kernel per step on a GPU).

    Uses the global torch RNG for the initial weights: seed it first for reproducible runs
    (with several workers the chief's values win anyway).

    >>> gan = build_cyclegan(ModelConfig(image_size=16, generator_filters=2, residual_blocks=0,
    ...                                  discriminator_filters=2, discriminator_layers=2))
    >>> gan.generator_g_optimizer.defaults["betas"]
    (0.5, 0.999)
    """
    config.validate()
    generator_g, generator_f = make_generator(config), make_generator(config)
    discriminator_x, discriminator_y = make_discriminator(config), make_discriminator(config)

    def adam(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=learning_rate, betas=(beta_1, 0.999), fused=fused)

    return CycleGAN(config, generator_g, generator_f, discriminator_x, discriminator_y,
                    adam(generator_g), adam(generator_f), adam(discriminator_x), adam(discriminator_y))


def per_sample_losses(gan: CycleGAN, real_x: torch.Tensor, real_y: torch.Tensor,
                      gan_loss: str = "lsgan", lambda_cycle: float = 10.0) -> dict[str, torch.Tensor]:
    """One forward pass of the tutorial's step: every loss of :data:`LOSS_KEYS`, and the four
    MAEs of :data:`MAE_KEYS`, each of shape ``(batch,)``.

    As the tutorial, the total cycle loss (both directions) enters both generators' totals, and
    each discriminator is scored on the very fakes the generators are judged by.

    >>> gan = build_cyclegan(ModelConfig(image_size=16, generator_filters=2, residual_blocks=0,
    ...                                  discriminator_filters=2, discriminator_layers=2))
    >>> losses = per_sample_losses(gan, torch.zeros(3, 3, 16, 16), torch.zeros(3, 3, 16, 16))
    >>> tuple(losses["loss_G/total"].shape)
    (3,)
    """
    if gan_loss not in GAN_LOSSES:
        raise ValueError(f"gan_loss must be one of {GAN_LOSSES}, got {gan_loss!r}.")
    fake_y = gan.generator_g(real_x)
    cycled_x = gan.generator_f(fake_y)
    fake_x = gan.generator_f(real_y)
    cycled_y = gan.generator_g(fake_x)
    same_x = gan.generator_f(real_x)
    same_y = gan.generator_g(real_y)

    disc_real_x, disc_fake_x = gan.discriminator_x(real_x), gan.discriminator_x(fake_x)
    disc_real_y, disc_fake_y = gan.discriminator_y(real_y), gan.discriminator_y(fake_y)

    gen_g = generator_loss(disc_fake_y, gan_loss)
    gen_f = generator_loss(disc_fake_x, gan_loss)
    total_cycle = cycle_loss(real_x, cycled_x, lambda_cycle) + cycle_loss(real_y, cycled_y, lambda_cycle)
    identity_g = identity_loss(real_y, same_y, lambda_cycle)
    identity_f = identity_loss(real_x, same_x, lambda_cycle)
    return {
        "loss_G/loss": gen_g,
        "loss_G/cycle": total_cycle,
        "loss_G/identity": identity_g,
        "loss_G/total": gen_g + total_cycle + identity_g,
        "loss_F/loss": gen_f,
        "loss_F/cycle": total_cycle,
        "loss_F/identity": identity_f,
        "loss_F/total": gen_f + total_cycle + identity_f,
        "loss_X/loss": discriminator_loss(disc_real_x, disc_fake_x, gan_loss),
        "loss_Y/loss": discriminator_loss(disc_real_y, disc_fake_y, gan_loss),
        "MAE/X_cycle": mean_absolute_error(real_x, cycled_x),
        "MAE/X_identity": mean_absolute_error(real_x, same_x),
        "MAE/Y_cycle": mean_absolute_error(real_y, cycled_y),
        "MAE/Y_identity": mean_absolute_error(real_y, same_y),
    }


def _zeros(keys: tuple[str, ...], like: torch.Tensor) -> dict[str, torch.Tensor]:
    return {key: like.new_zeros(()) for key in keys}


def make_train_step(gan: CycleGAN, global_batch_size: int, gan_loss: str = "lsgan",
                    lambda_cycle: float = 10.0, autocast_dtype: torch.dtype | None = None) -> StepFn:
    """``train_step(x, y) -> {loss name: scalar}``, to run once per replica.

    Each loss is ``td.compute_average_loss(per_sample, global_batch_size)``: this replica's
    share of the global mean, so the gradients the optimizers sum over replicas are those of
    the global mean. Each network gets the gradient of its own objective only (as the
    tutorial's ``tape.gradient(loss, model.trainable_variables)``): ``backward(inputs=...)``
    keeps, e.g., the generator loss out of the discriminators' gradients. All four gradients
    come from one forward pass with the current weights; then the four optimizers step, in
    the same order on every replica (each step is a point where the replicas meet).

    ``autocast_dtype`` (e.g. ``torch.bfloat16``): the forward pass and the losses run under
    ``torch.autocast`` on the replica's device, as PyTorch documents it (the backward passes
    and the optimizer steps outside it); the losses are cast back to float32.

    >>> # per_replica = strategy.run(make_train_step(gan, 64), args=(x, y))
    """
    if gan_loss not in GAN_LOSSES:
        raise ValueError(f"gan_loss must be one of {GAN_LOSSES}, got {gan_loss!r}.")
    objectives = (
        ("loss_G/total", gan.generator_g),
        ("loss_F/total", gan.generator_f),
        ("loss_X/loss", gan.discriminator_x),
        ("loss_Y/loss", gan.discriminator_y),
    )

    def train_step(real_x: torch.Tensor, real_y: torch.Tensor) -> dict[str, torch.Tensor]:
        if real_x.shape[0] == 0:
            # A replica without samples (ragged batch): nothing to add to the sums, but it
            # still takes part in the four optimizer steps below.
            losses = _zeros(LOSS_KEYS, real_x)
        else:
            if autocast_dtype is None:
                per_sample = per_sample_losses(gan, real_x, real_y, gan_loss, lambda_cycle)
            else:
                with torch.autocast(real_x.device.type, dtype=autocast_dtype):
                    per_sample = per_sample_losses(gan, real_x, real_y, gan_loss, lambda_cycle)
                per_sample = {key: value.float() for key, value in per_sample.items()}
            losses = {key: td.compute_average_loss(per_sample[key], global_batch_size=global_batch_size)
                      for key in LOSS_KEYS}
            for i, (key, model) in enumerate(objectives):
                losses[key].backward(inputs=list(model.parameters()),
                                     retain_graph=i < len(objectives) - 1)
        for optimizer in gan.optimizers():
            optimizer.step()
        for optimizer in gan.optimizers():
            optimizer.zero_grad()
        return {key: value.detach() for key, value in losses.items()}

    return train_step


def make_test_step(gan: CycleGAN, gan_loss: str = "lsgan", lambda_cycle: float = 10.0) -> StepFn:
    """``test_step(x, y, global_batch_size) -> {name: scalar}``: the losses and the four MAEs.

    The global batch size is an argument because a test set's last batch is usually smaller
    than the others: passing its true size keeps each value the exact mean over that batch.

    >>> # per_replica = strategy.run(make_test_step(gan), args=(x, y, 37))
    """
    if gan_loss not in GAN_LOSSES:
        raise ValueError(f"gan_loss must be one of {GAN_LOSSES}, got {gan_loss!r}.")
    keys = LOSS_KEYS + MAE_KEYS

    def test_step(real_x: torch.Tensor, real_y: torch.Tensor,
                  global_batch_size: int) -> dict[str, torch.Tensor]:
        if real_x.shape[0] == 0:
            return _zeros(keys, real_x)
        with torch.no_grad():
            per_sample = per_sample_losses(gan, real_x, real_y, gan_loss, lambda_cycle)
        return {key: td.compute_average_loss(per_sample[key], global_batch_size=global_batch_size)
                for key in keys}

    return test_step


def reduce_dict(strategy: td.Strategy, per_replica: Mapping[str, Any]) -> dict[str, float]:
    """SUM each per-replica value over all replicas (and workers): the global values.

    The scalars are stacked first, so this is one reduction (one collective across workers)
    however many losses there are. Every worker must call it.

    >>> import torch_distribute as td
    >>> strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> reduce_dict(strategy, {"loss": td.PerReplica([torch.tensor(0.25), torch.tensor(0.5)])})
    {'loss': 0.75}
    """
    keys = list(per_replica)
    if not keys:
        return {}
    components = [strategy.experimental_local_results(per_replica[key]) for key in keys]
    stacked = td.PerReplica([
        torch.stack([torch.as_tensor(values[replica]) for values in components])
        for replica in range(len(components[0]))
    ])
    totals = strategy.reduce(td.ReduceOp.SUM, stacked, axis=None)
    return dict(zip(keys, totals.tolist(), strict=True))
