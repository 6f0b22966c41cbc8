"""Train CycleGAN with any torch-distribute strategy: the same program on 1 device, N replicas
or N workers.

    python -m examples.cyclegan.train                                # 2 CPU replicas / all GPUs
    python -m examples.cyclegan.train --strategy one --epochs 3
    python -m examples.cyclegan.train --data-dir ~/horse2zebra --image-size 256 \\
        --generator-filters 64 --residual-blocks 9 --discriminator-filters 64 \\
        --batch-size-per-replica 1 --epochs 40
    python -m torch_distribute.launch --nproc 2 -m examples.cyclegan.train --strategy multiworker
    python -m examples.cyclegan.train --resume --epochs 10           # continue the last run
    python -m examples.cyclegan.train --strategy one --compile       # td.function (@tf.function)

Data: the CycleGAN folders (trainA/ trainB/ testA/ testB/) from ``--data-dir``, else
scikit-learn's bundled digits drawn as two domains (no download). Per epoch: a progress bar
for Train and for Test, the test MAEs and the time. Only the chief writes: TensorBoard
scalars and translation figures under ``<output-dir>/tensorboard``, PNGs under
``<output-dir>/images``, checkpoints under ``<output-dir>/checkpoints``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

import torch_distribute as td
from examples.cyclegan.data import (
    Domains,
    UnpairedImages,
    global_batch_sizes,
    load_domains,
    make_loader,
    plot_batch,
)
from examples.cyclegan.losses import GAN_LOSSES
from examples.cyclegan.models import ModelConfig
from examples.cyclegan.steps import (
    MAE_KEYS,
    MAE_LABELS,
    CycleGAN,
    build_cyclegan,
    make_test_step,
    make_train_step,
    reduce_dict,
)

__all__ = ["TrainResult", "main", "make_strategy", "parse_args", "run_training"]

PLOT_IMAGES = 5
CHECKPOINTS_TO_KEEP = 3
CURVE_KEYS = ("loss_G/total", "loss_F/total", "loss_X/loss", "loss_Y/loss")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m examples.cyclegan.train", description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--strategy", choices=["one", "mirrored", "multiworker"], default="mirrored")
    parser.add_argument(
        "--devices", default=None,
        help="comma-separated devices, e.g. 'cpu:0,cpu:1' or 'cuda:0,cuda:1' (default: all GPUs, "
        "else 2 CPU replicas for mirrored; cuda:0 or cpu for one; multiworker: one per worker)")
    parser.add_argument("--epochs", type=_positive_int, default=5)
    parser.add_argument("--batch-size-per-replica", type=_positive_int, default=8)
    parser.add_argument("--image-size", type=_positive_int, default=32,
                        help="images are resized to this square size (a multiple of 4)")
    parser.add_argument("--data-dir", default=None,
                        help="a CycleGAN dataset folder with trainA/ trainB/ testA/ testB/ "
                        "(default: scikit-learn digits drawn as two domains)")
    parser.add_argument("--output-dir", default=None,
                        help="TensorBoard logs, images and checkpoints "
                        "(default: <tmp>/td_cyclegan, shared by the workers of one machine)")
    parser.add_argument("--seed", type=int, default=0, help="weights and data order")
    parser.add_argument("--resume", action="store_true",
                        help="restore the latest checkpoint in <output-dir>/checkpoints, if any, "
                        "and continue from its epoch")
    parser.add_argument("--checkpoint-every", type=_positive_int, default=1, metavar="EPOCHS",
                        help="save a checkpoint every this many epochs (and after the last)")
    parser.add_argument("--plot-every", type=_positive_int, default=1, metavar="EPOCHS",
                        help="plot the translations of 5 test images every this many epochs "
                        "(and after the last)")
    parser.add_argument("--gan-loss", choices=GAN_LOSSES, default="lsgan",
                        help="adversarial loss: least squares (paper) or cross-entropy (tutorial)")
    parser.add_argument("--lambda-cycle", type=_positive_float, default=10.0,
                        help="weight of the cycle loss (the identity loss gets half of it)")
    parser.add_argument("--learning-rate", type=_positive_float, default=2e-4)
    parser.add_argument("--beta-1", type=float, default=0.5, help="Adam's beta_1")
    parser.add_argument("--generator-filters", type=_positive_int, default=16,
                        help="filters of the generators' first layer (paper: 64)")
    parser.add_argument("--residual-blocks", type=int, default=3,
                        help="residual blocks of each generator (paper: 9 at 256x256)")
    parser.add_argument("--discriminator-filters", type=_positive_int, default=16,
                        help="filters of the discriminators' first layer (paper: 64)")
    parser.add_argument("--discriminator-layers", type=_positive_int, default=3,
                        help="stride-2 layers of each PatchGAN discriminator (paper: 3)")
    parser.add_argument("--steps-per-epoch", type=_positive_int, default=None,
                        help="at most this many training steps per epoch (default: all)")
    parser.add_argument("--test-steps", type=_positive_int, default=None,
                        help="at most this many test batches per epoch (default: all)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                        help="float64 makes 1 and N replicas agree to ~1e-11 for ten steps "
                        "(a check that differences in float32 are rounding only; the training "
                        "dynamics amplify any rounding difference later on)")
    parser.add_argument("--loader-workers", type=int, default=0,
                        help="DataLoader worker processes (image folders decode faster with some)")
    parser.add_argument("--compile", action="store_true",
                        help="wrap the distributed train and test steps in td.function (the "
                        "tutorial's @tf.function): each replica's step is compiled once, with "
                        "torch.compile; the first steps pay the compilation")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line; bad values exit with a message naming the option.

    >>> parse_args(["--strategy", "one", "--epochs", "2"]).epochs
    2
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.residual_blocks < 0:
        parser.error(f"--residual-blocks must be >= 0, got {args.residual_blocks}")
    if args.loader_workers < 0:
        parser.error(f"--loader-workers must be >= 0, got {args.loader_workers}")
    if not 0.0 <= args.beta_1 < 1.0:
        parser.error(f"--beta-1 must be in [0, 1), got {args.beta_1}")
    try:
        model_config(args).validate()
    except ValueError as e:
        parser.error(str(e))
    if args.data_dir is not None:
        try:
            load_domains(args.data_dir, args.image_size)
        except FileNotFoundError as e:
            parser.error(str(e))
    return args


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        image_size=args.image_size,
        generator_filters=args.generator_filters,
        residual_blocks=args.residual_blocks,
        discriminator_filters=args.discriminator_filters,
        discriminator_layers=args.discriminator_layers,
    )


def make_strategy(name: str, devices: str | None) -> td.Strategy:
    """The strategy named on the command line (the only strategy-specific line).

    >>> make_strategy("one", "cpu").num_replicas_in_sync
    1
    """
    device_list = devices.split(",") if devices else None
    if name == "one":
        default = "cuda:0" if torch.cuda.is_available() else "cpu"
        return td.OneDeviceStrategy(device_list[0] if device_list else default)
    if name == "multiworker":
        # The cluster comes from TF_CONFIG, torchrun's variables or SLURM.
        return td.MultiWorkerMirroredStrategy(devices=device_list)
    if device_list is None and not torch.cuda.is_available():
        device_list = ["cpu:0", "cpu:1"]
    return td.MirroredStrategy(device_list)


@dataclass
class TrainResult:
    """What a run leaves behind (also returned on non-chief workers)."""

    gan: CycleGAN
    strategy: td.Strategy
    output_dir: str
    start_epoch: int
    epochs: list[dict[str, float]] = field(default_factory=list)
    """Per epoch: ``train/<loss>``, ``test/<loss>``, ``test/MAE/...``, ``seconds``."""
    steps: list[dict[str, float]] = field(default_factory=list)
    """Per training step: the global value of every loss."""
    tracing_counts: dict[str, int] = field(default_factory=dict)
    """With ``--compile``: graphs compiled for the ``train`` and ``test`` steps (every replica's)."""


class Summaries:
    """TensorBoard scalars and figures plus PNG files, written by the chief only."""

    def __init__(self, output_dir: str, enabled: bool):
        self.enabled = enabled
        self.image_dir = os.path.join(output_dir, "images")
        self._writer: Any = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(os.path.join(output_dir, "tensorboard"))

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self._writer is not None:
            for key, value in values.items():
                self._writer.add_scalar(key, value, step)
            self._writer.flush()

    def figure(self, tag: str, figure: Any, step: int, filename: str) -> str | None:
        from examples.cyclegan.plots import save_figure

        if not self.enabled:
            return None
        path = save_figure(figure, os.path.join(self.image_dir, filename), close=False)
        self._writer.add_figure(tag, figure, step)  # closes the figure
        self._writer.flush()
        return path

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _mean_of(rows: Iterable[tuple[dict[str, float], float]]) -> dict[str, float]:
    """Weighted mean of dicts of global batch means (weight: the batch size)."""
    totals: dict[str, float] = {}
    weight = 0.0
    for values, w in rows:
        weight += w
        for key, value in values.items():
            totals[key] = totals.get(key, 0.0) + value * w
    return {key: value / weight for key, value in totals.items()} if weight else {}


def _progress(iterable: Iterable[Any], desc: str, total: int, enabled: bool) -> tqdm:
    return tqdm(iterable, desc=desc, total=total, disable=not enabled, dynamic_ncols=True)


def main(argv: list[str] | None = None) -> TrainResult:
    """Train; every worker returns the same :class:`TrainResult` numbers.

    >>> result = main(["--strategy", "one", "--epochs", "1"])  # doctest: +SKIP
    >>> result.epochs[-1]["test/MAE/X_cycle"]  # doctest: +SKIP
    0.1374
    """
    args = parse_args(argv)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, args.dtype))  # the networks' and the images' dtype
    try:
        return run_training(args)
    finally:
        torch.set_default_dtype(previous_dtype)


def run_training(args: argparse.Namespace) -> TrainResult:
    """The training loop for parsed arguments (see :func:`parse_args`)."""
    domains = load_domains(args.data_dir, args.image_size)
    torch.manual_seed(args.seed)
    strategy = make_strategy(args.strategy, args.devices)
    is_chief = strategy.extended.should_checkpoint
    log: Callable[..., None] = print if is_chief else (lambda *_a, **_k: None)
    show_progress = is_chief and not args.no_progress
    output_dir = args.output_dir or os.path.join(tempfile.gettempdir(), "td_cyclegan")

    global_batch_size = args.batch_size_per_replica * strategy.num_replicas_in_sync
    log(f"Number of devices: {strategy.num_replicas_in_sync} ({strategy})")
    log(f"Data: {domains.description}")
    log(f"Global batch: {global_batch_size} ({args.batch_size_per_replica} per replica); "
        f"output: {output_dir}")

    train_data, test_data, loaders = _datasets(domains, args, global_batch_size)
    train_loader, test_loader = loaders
    train_dist = strategy.experimental_distribute_dataset(train_loader)
    test_dist = strategy.experimental_distribute_dataset(test_loader)
    steps_per_epoch = min(len(train_loader), args.steps_per_epoch or len(train_loader))
    test_sizes = global_batch_sizes(len(test_data), global_batch_size, drop_last=False)
    test_sizes = test_sizes[: args.test_steps or len(test_sizes)]
    plot_x, plot_y = plot_batch(test_data, PLOT_IMAGES)

    with strategy.scope():
        torch.manual_seed(args.seed)  # the same initial weights whatever the strategy
        gan = build_cyclegan(model_config(args), args.learning_rate, args.beta_1)
        epoch_counter = torch.zeros((), dtype=torch.int64)
        checkpoint = gan.checkpoint(epoch=epoch_counter)
        manager = td.CheckpointManager(checkpoint, os.path.join(output_dir, "checkpoints"),
                                       max_to_keep=CHECKPOINTS_TO_KEEP)
        if args.resume:
            # Every worker restores (changes outside run are not sent to other workers).
            restored = manager.restore_or_initialize()
            log(f"Resumed from {restored} (epoch {int(epoch_counter)})" if restored else
                f"No checkpoint in {manager.directory}: starting from scratch")
    for model in gan.models().values():
        model.train()  # no dropout or batch norm: train and eval modes compute the same

    train_step = make_train_step(gan, global_batch_size, args.gan_loss, args.lambda_cycle)
    test_step = make_test_step(gan, args.gan_loss, args.lambda_cycle)

    def distributed_train_step(x: Any, y: Any) -> dict[str, float]:
        return reduce_dict(strategy, strategy.run(train_step, args=(x, y)))

    def distributed_test_step(x: Any, y: Any, size: int) -> dict[str, float]:
        return reduce_dict(strategy, strategy.run(test_step, args=(x, y, size)))

    if args.compile:
        # The tutorial decorates its distributed steps with @tf.function. dynamic=False: one
        # graph per input shape, as tf.function traces one per input signature. (A graph with
        # dynamic shapes gets its backward compiled ahead of time, and torch then refuses the
        # backward(retain_graph=True) of the train step's four backward passes.)
        distributed_train_step = td.function(distributed_train_step, dynamic=False)
        distributed_test_step = td.function(distributed_test_step, dynamic=False)
    summaries = Summaries(output_dir, enabled=strategy.extended.should_save_summary)
    result = TrainResult(gan, strategy, output_dir, start_epoch=int(epoch_counter))
    if result.start_epoch >= args.epochs:
        log(f"Already trained for {result.start_epoch} epochs (--epochs {args.epochs}): nothing to do")

    for epoch in range(result.start_epoch, args.epochs):
        log(f"Epoch {epoch + 1}/{args.epochs}")
        started = time.perf_counter()
        train_data.set_epoch(epoch)
        train_rows = []
        epoch_batches = itertools.islice(train_dist, steps_per_epoch)
        with _progress(epoch_batches, "Train", steps_per_epoch, show_progress) as batches:
            for x, y in batches:
                losses = distributed_train_step(x, y)
                result.steps.append(losses)
                train_rows.append((losses, 1.0))
        test_rows = []
        epoch_batches = zip(test_sizes, itertools.islice(test_dist, len(test_sizes)), strict=True)
        with _progress(epoch_batches, "Test", len(test_sizes), show_progress) as batches:
            for size, (x, y) in batches:
                test_rows.append((distributed_test_step(x, y, size), size))
        elapsed = time.perf_counter() - started

        record = {f"train/{k}": v for k, v in _mean_of(train_rows).items()}
        record.update({f"test/{k}": v for k, v in _mean_of(test_rows).items()})
        record["seconds"] = elapsed
        result.epochs.append(record)
        log("  ".join(f"{MAE_LABELS[k]}: {record[f'test/{k}']:.4f}" for k in MAE_KEYS[:2]))
        log("  ".join(f"{MAE_LABELS[k]}: {record[f'test/{k}']:.4f}" for k in MAE_KEYS[2:]))
        log(f"Elapse: {elapsed:.2f}s")

        summaries.scalars({k: v for k, v in record.items() if k != "seconds"}, epoch + 1)
        last = epoch + 1 == args.epochs
        if (epoch + 1) % args.plot_every == 0 or last:
            _plot_translations(summaries, gan, plot_x, plot_y, epoch + 1)
        epoch_counter.fill_(epoch + 1)
        if (epoch + 1) % args.checkpoint_every == 0 or last:
            manager.save(checkpoint_number=epoch + 1)  # every worker calls it; the chief writes

    if args.compile:
        result.tracing_counts = {
            "train": distributed_train_step.experimental_get_tracing_count(),
            "test": distributed_test_step.experimental_get_tracing_count(),
        }
        log(f"td.function graphs compiled: {result.tracing_counts['train']} for the train step, "
            f"{result.tracing_counts['test']} for the test step")
    if summaries.enabled and result.steps:
        from examples.cyclegan.plots import loss_curves_figure

        replicas = strategy.num_replicas_in_sync
        title = f"CycleGAN training losses ({replicas} replica{'s' if replicas > 1 else ''})"
        figure = loss_curves_figure({"train": result.steps}, CURVE_KEYS, xlabel="step", title=title)
        summaries.figure("loss_curves", figure, args.epochs, "loss_curves.png")
    summaries.close()
    return result


def _datasets(domains: Domains, args: argparse.Namespace, global_batch_size: int) -> tuple[
        UnpairedImages, UnpairedImages, tuple[torch.utils.data.DataLoader, torch.utils.data.DataLoader]]:
    train_data = UnpairedImages(domains.train_x, domains.train_y, train=True, seed=args.seed)
    test_data = UnpairedImages(domains.test_x, domains.test_y, train=False)
    try:
        train_loader = make_loader(train_data, global_batch_size, train=True,
                                   num_workers=args.loader_workers)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e
    test_loader = make_loader(test_data, global_batch_size, train=False,
                              num_workers=args.loader_workers)
    return train_data, test_data, (train_loader, test_loader)


def _plot_translations(summaries: Summaries, gan: CycleGAN, x: torch.Tensor, y: torch.Tensor,
                       epoch: int) -> None:
    if not summaries.enabled:
        return
    from examples.cyclegan.plots import translate, translation_figure

    figure = translation_figure(translate(gan, x, y), title=f"Epoch {epoch}")
    summaries.figure("translations", figure, epoch, f"epoch_{epoch:03d}.png")


if __name__ == "__main__":
    main()
