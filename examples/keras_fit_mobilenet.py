"""MobileNetV2 trained from scratch with Keras' compile/fit under a distribution strategy.

The seed's program: an image-folder data set (``cats/ dogs/`` style class folders) read with
``image_dataset_from_directory``, ``MobileNetV2(weights=None, classes=2)`` created in
``strategy.scope()``, ``compile``/``fit``/``evaluate``. Only the strategy line differs
between one device, CPU replicas / all GPUs, and several workers.

    python examples/keras_fit_mobilenet.py                               # 2 CPU replicas, 224x224
    python examples/keras_fit_mobilenet.py --image-size 96 --alpha 0.35  # CPU: ~9 s/epoch, ~90% at epoch 8
    python examples/keras_fit_mobilenet.py --data-dir ~/cats_and_dogs/train
    torch-distribute launch --nproc 2 examples/keras_fit_mobilenet.py --strategy multiworker

Default data (no download): random crops of scikit-learn's two bundled photos
(``load_sample_images()``: china.jpg and flower.jpg) as two classes, written as JPEG files to
class folders, deterministic by ``--seed``; 20% of the files are held out for validation.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch
from torch import nn

import torch_distribute as td
from torch_distribute.keras.applications.mobilenet_v2 import preprocess_input


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["one", "mirrored", "multiworker"], default="mirrored")
    parser.add_argument("--devices", default=None, help="comma-separated devices, e.g. cpu:0,cpu:1")
    parser.add_argument("--data-dir", default=None, help="a folder of class folders (default: the sample-photo crops)")
    parser.add_argument("--images-per-class", type=int, default=160, help="default data: crops per class")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--alpha", type=float, default=1.0, help="MobileNetV2 width multiplier")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size-per-replica", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--steps-per-epoch", type=int, default=None)
    parser.add_argument("--output-dir", default=None, help="checkpoints, CSV log, TensorBoard (default: a temporary folder)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", type=int, default=1)
    return parser.parse_args(argv)


def make_strategy(name: str, devices: str | None) -> td.Strategy:
    device_list = devices.split(",") if devices else None
    if name == "one":
        default = "cuda:0" if torch.cuda.is_available() else "cpu"
        return td.OneDeviceStrategy(device_list[0] if device_list else default)
    if name == "multiworker":
        return td.MultiWorkerMirroredStrategy(devices=device_list)
    if device_list is None and not torch.cuda.is_available():
        device_list = ["cpu:0", "cpu:1"]
    return td.MirroredStrategy(device_list)


def write_sample_crops(directory: str, per_class: int, seed: int) -> str:
    """Random square crops (flipped at random) of the two sklearn sample photos, as class folders."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = load_sample_images()
    rng = np.random.default_rng(seed)
    for name, image in zip(("china", "flower"), photos.images, strict=True):
        folder = os.path.join(directory, name)
        os.makedirs(folder, exist_ok=True)
        height, width, _ = image.shape
        for i in range(per_class):
            side = int(rng.integers(96, min(height, width) // 2))
            top, left = int(rng.integers(0, height - side)), int(rng.integers(0, width - side))
            crop = image[top:top + side, left:left + side]
            if rng.random() < 0.5:
                crop = crop[:, ::-1]
            Image.fromarray(np.ascontiguousarray(crop)).save(os.path.join(folder, f"{i:04d}.jpg"), quality=90)
    return directory


class Preprocess(nn.Module):
    """Pixels in [0, 255] to MobileNetV2's [-1, 1] (``keras.applications.mobilenet_v2.preprocess_input``)."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return preprocess_input(images)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    strategy = make_strategy(args.strategy, args.devices)
    is_chief = strategy.extended.should_checkpoint
    log = print if is_chief else (lambda *a, **k: None)
    log(f"Number of devices: {strategy.num_replicas_in_sync}")

    output_dir = args.output_dir or (os.path.join(tempfile.gettempdir(), "td_keras_mobilenet")
                                     if args.strategy == "multiworker" else tempfile.mkdtemp(prefix="td_keras_mobilenet_"))
    data_dir = args.data_dir
    if data_dir is None:
        data_dir = os.path.join(output_dir, f"sample_crops_{args.images_per_class}_{args.seed}")
        if is_chief and not os.path.isdir(data_dir):
            write_sample_crops(data_dir + ".tmp", args.images_per_class, args.seed)
            os.replace(data_dir + ".tmp", data_dir)
        # A reduction is a barrier: every worker waits until the chief has written the files.
        strategy.reduce("mean", torch.zeros(()), axis=None)
    global_batch = args.batch_size_per_replica * strategy.num_replicas_in_sync
    train_ds, val_ds = td.keras.preprocessing.image_dataset_from_directory(
        data_dir, validation_split=0.2, subset="both", seed=args.seed,
        image_size=(args.image_size, args.image_size), batch_size=global_batch)
    train_ds, val_ds = train_ds.cache(), val_ds.cache()
    log(f"Data: {len(train_ds.file_paths)} training and {len(val_ds.file_paths)} validation images of "
        f"{train_ds.class_names} from {data_dir}")

    with strategy.scope():
        base = td.keras.applications.MobileNetV2(
            input_shape=(3, args.image_size, args.image_size), alpha=args.alpha, classes=len(train_ds.class_names),
            weights=None, batch_norm_momentum=0.9)  # 0.9: short training from scratch
        model = td.keras.Model(nn.Sequential(Preprocess(), base), name="mobilenetv2")
    model.compile(optimizer=td.keras.optimizers.Adam(learning_rate=args.learning_rate),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    callbacks = [
        td.keras.callbacks.ModelCheckpoint(os.path.join(output_dir, "ckpt-{epoch:02d}.pt"), monitor="val_accuracy",
                                           save_best_only=True),
        td.keras.callbacks.CSVLogger(os.path.join(output_dir, "training.csv")),
        td.keras.callbacks.TensorBoard(os.path.join(output_dir, "logs")),
        td.keras.callbacks.BackupAndRestore(os.path.join(output_dir, "backup")),
    ]
    started = time.perf_counter()
    history = model.fit(train_ds, validation_data=val_ds, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch,
                        callbacks=callbacks, verbose=args.verbose)
    seconds_per_epoch = (time.perf_counter() - started) / max(len(history.epoch), 1)
    loss, accuracy = model.evaluate(val_ds, verbose=0)
    log(f"Validation: loss {loss:.4f}, accuracy {accuracy * 100:.2f}% ({seconds_per_epoch:.1f}s per epoch); "
        f"outputs in {output_dir}")
    return {"loss": loss, "accuracy": accuracy, "seconds_per_epoch": seconds_per_epoch, "output_dir": output_dir}


if __name__ == "__main__":
    main()
