"""TensorFlow's "Custom training with tf.distribute.Strategy" tutorial, ported line by line.

The same program runs on one device, on every GPU of a machine (or CPU replicas), and
(later) on several machines: only the strategy line changes.

    python examples/custom_training_loop.py --strategy mirrored            # 2 CPU replicas / all GPUs
    python examples/custom_training_loop.py --strategy one --epochs 5
    python examples/custom_training_loop.py --data-dir ~/fashion_mnist     # the four IDX .gz files
    torch-distribute launch --nproc 2 examples/custom_training_loop.py --strategy multiworker

Data: Fashion-MNIST from ``--data-dir`` when given, else scikit-learn's bundled handwritten
digits resized to 28x28 (no download).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import torch_distribute as td
from torch_distribute.datasets import load_image_classification_data, make_loader


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["one", "mirrored", "multiworker"], default="mirrored")
    parser.add_argument(
        "--devices",
        default=None,
        help="comma-separated devices, e.g. 'cpu:0,cpu:1' or 'cuda:0,cuda:1' "
        "(default: all GPUs, else 2 CPU replicas for mirrored; cuda:0 or cpu for one)",
    )
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size-per-replica", type=int, default=64)
    parser.add_argument("--cosine-decay", action="store_true",
                        help="decay the learning rate to 0 over the run (stepped inside train_step)")
    parser.add_argument("--data-dir", default=None, help="folder with the Fashion-MNIST IDX .gz files")
    parser.add_argument(
        "--checkpoint-dir", default=None,
        help="default: a new temporary folder (multiworker: <tmp>/td_training_checkpoints, shared by the workers)",
    )
    parser.add_argument("--compile", action="store_true",
                        help="compile the replica steps with td.function (the tutorial's @tf.function)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def make_strategy(name: str, devices: str | None) -> td.Strategy:
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


def create_model() -> nn.Module:
    """The tutorial's CNN: Conv32-Pool-Conv64-Pool-Dense64-Dense10."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 5 * 5, 64), nn.ReLU(), nn.Linear(64, 10),
    )


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    strategy = make_strategy(args.strategy, args.devices)
    is_chief = strategy.extended.should_checkpoint
    log = print if is_chief else (lambda *_args, **_kwargs: None)
    log(f"Number of devices: {strategy.num_replicas_in_sync} ({strategy})")

    (train_images, train_labels), (test_images, test_labels), source = load_image_classification_data(args.data_dir)
    log(f"Data: {source}")

    BATCH_SIZE_PER_REPLICA = args.batch_size_per_replica
    GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
    EPOCHS = args.epochs

    train_dataset = make_loader(train_images, train_labels, GLOBAL_BATCH_SIZE, shuffle=True, seed=args.seed)
    test_dataset = make_loader(test_images, test_labels, GLOBAL_BATCH_SIZE, shuffle=False)
    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

    checkpoint_dir = args.checkpoint_dir
    if checkpoint_dir is None:
        checkpoint_dir = (
            os.path.join(tempfile.gettempdir(), "td_training_checkpoints")
            if args.strategy == "multiworker"
            else tempfile.mkdtemp(prefix="td_training_checkpoints_")
        )
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")

    with strategy.scope():
        model = create_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        scheduler = (
            torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=EPOCHS * len(train_dist_dataset))
            if args.cosine_decay else None
        )
        checkpoint = td.Checkpoint(optimizer=optimizer, model=model)

        def compute_loss(labels: torch.Tensor, predictions: torch.Tensor) -> torch.Tensor:
            per_example_loss = F.cross_entropy(predictions, labels, reduction="none")
            return td.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)

        test_loss = td.metrics.Mean(name="test_loss")
        train_accuracy = td.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_accuracy = td.metrics.SparseCategoricalAccuracy(name="test_accuracy")

    def train_step(inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = inputs
        model.train()
        predictions = model(images)
        loss = compute_loss(labels, predictions)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()  # every replica calls it; it advances once per step
        train_accuracy.update_state(labels, predictions)
        return loss

    def test_step(inputs: tuple[torch.Tensor, torch.Tensor]) -> None:
        images, labels = inputs
        with torch.no_grad():
            predictions = model(images)
            t_loss = F.cross_entropy(predictions, labels, reduction="none")
        test_loss.update_state(t_loss)
        test_accuracy.update_state(labels, predictions)

    def distributed_train_step(dataset_inputs: td.PerReplica) -> torch.Tensor:
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(td.ReduceOp.SUM, per_replica_losses, axis=None)

    def distributed_test_step(dataset_inputs: td.PerReplica) -> None:
        strategy.run(test_step, args=(dataset_inputs,))

    if args.compile:  # the tutorial decorates both with @tf.function
        distributed_train_step = td.function(distributed_train_step)
        distributed_test_step = td.function(distributed_test_step)

    for epoch in range(EPOCHS):
        started = time.perf_counter()
        total_loss = 0.0
        num_batches = 0
        for x in tqdm(train_dist_dataset, desc=f"Epoch {epoch + 1}/{EPOCHS}", leave=False,
                      disable=args.no_progress or not is_chief):
            total_loss += distributed_train_step(x)
            num_batches += 1
        train_loss = total_loss / num_batches

        for x in test_dist_dataset:
            distributed_test_step(x)

        if epoch % 2 == 0:
            checkpoint.save(checkpoint_prefix)  # every worker calls it; only the chief writes

        log(
            f"Epoch {epoch + 1}, Loss: {float(train_loss):.4f}, "
            f"Accuracy: {float(train_accuracy.result()) * 100:.2f}, "
            f"Test Loss: {float(test_loss.result()):.4f}, "
            f"Test Accuracy: {float(test_accuracy.result()) * 100:.2f} "
            f"({time.perf_counter() - started:.1f}s)"
        )
        if epoch < EPOCHS - 1:
            test_loss.reset_state()
            train_accuracy.reset_state()
            test_accuracy.reset_state()

    final_test_accuracy = float(test_accuracy.result())  # a collective: every worker reads it
    if not is_chief:
        return final_test_accuracy
    # Restore the latest checkpoint *without* a strategy and evaluate it, as the tutorial does.
    eval_accuracy = td.metrics.SparseCategoricalAccuracy(name="eval_accuracy")
    new_model = create_model()
    new_optimizer = torch.optim.Adam(new_model.parameters(), lr=1e-3)
    restored = td.Checkpoint(optimizer=new_optimizer, model=new_model)
    restored.restore(td.latest_checkpoint(checkpoint_dir))
    new_model.eval()
    with torch.no_grad():
        for images, labels in test_dataset:
            eval_accuracy.update_state(labels, new_model(images))
    accuracy = float(eval_accuracy.result())
    print(f"Accuracy after restoring the saved model without strategy: {accuracy * 100:.2f}")
    return accuracy


if __name__ == "__main__":
    main()
