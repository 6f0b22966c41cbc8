"""TensorFlow's distributed Keras tutorials, ported with mechanical changes only.

Three tutorials of tensorflow/docs (site/en/tutorials/distribute/), each a function here,
line by line in the tutorial's order: Keras layers became ``torch.nn`` modules (channels
first), ``tf.data`` pipelines ``DataLoader``s, ``tf.`` ``td.``. MNIST is not downloaded:
``mnist_like`` draws 28x28 images whose label is a learnable function of the pixels (the
same shapes and dtypes). Comments ``# TF:`` mark the lines that needed more than a new name
(see docs/porting.md).

    python examples/tf_tutorials.py keras            # tutorials/distribute/keras.ipynb
    python examples/tf_tutorials.py save_and_load    # tutorials/distribute/save_and_load.ipynb
    python examples/tf_tutorials.py parameter_server # the Model.fit part of parameter_server_training.ipynb
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

import torch_distribute as td


def mnist_like(n: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    """``n`` images (1x28x28, 0-255 as uint8) and labels 0-9 that depend on the pixels."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 1, 28, 28), generator=generator, dtype=torch.uint8)
    labels = (images[:, 0, :10, :10].float().mean((1, 2)) / 25.6).long().clamp(0, 9)
    return torch.utils.data.TensorDataset(images, labels)


def scale(image: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    image = image.to(torch.float32)
    image /= 255
    return image, label


class Scaled(torch.utils.data.Dataset):
    """TF: ``dataset.map(scale)``."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return scale(*self.dataset[index])


def mnist_cnn() -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3), torch.nn.ReLU(),  # TF: Conv2D(32, 3, activation='relu', input_shape=(28, 28, 1))
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 13 * 13, 64), torch.nn.ReLU(),  # TF: Dense(64, activation='relu'): input size given
        torch.nn.Linear(64, 10),
    )


# -- tutorials/distribute/keras.ipynb ------------------------------------------------------------
def keras_tutorial(workdir: str, num_train: int = 512, num_test: int = 128, epochs: int = 12) -> dict:
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])  # TF: MirroredStrategy() finds the GPUs
    print(f"Number of devices: {strategy.num_replicas_in_sync}")
    mnist_train, mnist_test = mnist_like(num_train), mnist_like(num_test, seed=1)

    BATCH_SIZE_PER_REPLICA = 64
    BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync

    train_dataset = torch.utils.data.DataLoader(Scaled(mnist_train), batch_size=BATCH_SIZE, shuffle=True)
    eval_dataset = torch.utils.data.DataLoader(Scaled(mnist_test), batch_size=BATCH_SIZE)

    with strategy.scope():
        model = td.keras.Model(mnist_cnn())
        model.compile(loss=td.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=td.keras.optimizers.Adam(),
                      metrics=["accuracy"])

    checkpoint_dir = os.path.join(workdir, "training_checkpoints")
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch}")

    def decay(epoch):
        if epoch < 3:
            return 1e-3
        elif epoch >= 3 and epoch < 7:
            return 1e-4
        else:
            return 1e-5

    class PrintLR(td.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            print(f"\nLearning rate for epoch {epoch + 1} is {model.optimizer.learning_rate}")  # TF: .lr.numpy()

    callbacks = [
        td.keras.callbacks.TensorBoard(log_dir=os.path.join(workdir, "logs")),
        td.keras.callbacks.ModelCheckpoint(filepath=checkpoint_prefix, save_weights_only=True),
        td.keras.callbacks.LearningRateScheduler(decay),
        PrintLR(),
    ]
    history = model.fit(train_dataset, epochs=epochs, callbacks=callbacks)
    print(sorted(os.listdir(checkpoint_dir)))

    model.load_weights(os.path.join(checkpoint_dir, f"ckpt_{epochs}"))  # TF: tf.train.latest_checkpoint(dir)
    eval_loss, eval_acc = model.evaluate(eval_dataset)
    print(f"Eval loss: {eval_loss}, Eval Accuracy: {eval_acc}")

    path = os.path.join(workdir, "saved_model.pt")  # TF: 'saved_model/' (a SavedModel directory)
    model.save(path)

    unreplicated_model = td.keras.models.load_model(path)
    unreplicated_model.compile(
        loss=td.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=td.keras.optimizers.Adam(),
        metrics=["accuracy"])
    unreplicated = unreplicated_model.evaluate(eval_dataset)
    print(f"Eval loss: {unreplicated[0]}, Eval Accuracy: {unreplicated[1]}")

    with strategy.scope():
        replicated_model = td.keras.models.load_model(path)
        replicated_model.compile(loss=td.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                 optimizer=td.keras.optimizers.Adam(),
                                 metrics=["accuracy"])
        replicated = replicated_model.evaluate(eval_dataset)
        print(f"Eval loss: {replicated[0]}, Eval Accuracy: {replicated[1]}")
    return {"history": history.history, "eval": [eval_loss, eval_acc], "unreplicated": unreplicated,
            "replicated": replicated}


# -- tutorials/distribute/save_and_load.ipynb ----------------------------------------------------
def save_and_load_guide(workdir: str, num_train: int = 512, epochs: int = 2) -> dict:
    mirrored_strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])

    def get_data():
        BUFFER_SIZE = 10000  # noqa: F841 - TF: shuffle(BUFFER_SIZE): DataLoader(shuffle=True) shuffles all rows
        BATCH_SIZE_PER_REPLICA = 64
        BATCH_SIZE = BATCH_SIZE_PER_REPLICA * mirrored_strategy.num_replicas_in_sync
        mnist_train, mnist_test = mnist_like(num_train), mnist_like(num_train // 4, seed=1)
        train_dataset = torch.utils.data.DataLoader(Scaled(mnist_train), batch_size=BATCH_SIZE, shuffle=True)
        eval_dataset = torch.utils.data.DataLoader(Scaled(mnist_test), batch_size=BATCH_SIZE)
        return train_dataset, eval_dataset

    def get_model():
        with mirrored_strategy.scope():
            model = td.keras.Model(mnist_cnn())
            model.compile(loss=td.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          optimizer=td.keras.optimizers.Adam(),
                          metrics=[td.keras.metrics.SparseCategoricalAccuracy()])
            return model

    model = get_model()
    train_dataset, eval_dataset = get_data()
    model.fit(train_dataset, epochs=epochs)

    # The Keras API
    keras_model_path = os.path.join(workdir, "keras_save.pt")  # TF: '/tmp/keras_save.keras'
    model.save(keras_model_path)

    restored_keras_model = td.keras.models.load_model(keras_model_path)
    restored = restored_keras_model.fit(train_dataset, epochs=epochs)

    another_strategy = td.OneDeviceStrategy("cpu:0")
    with another_strategy.scope():
        restored_keras_model_ds = td.keras.models.load_model(keras_model_path)
        restored_ds = restored_keras_model_ds.fit(train_dataset, epochs=epochs)

    # The tf.saved_model API. TF: tf.saved_model.save/load and loaded.signatures[...]: torch.export
    # for serving; td.keras.models.load_model (or torch.load of a whole module) for training.
    saved_model_path = os.path.join(workdir, "tf_save.pt2")
    example = next(iter(eval_dataset))[0]
    program = torch.export.export(td.keras.models.load_model(keras_model_path).module.eval(), (example,))
    torch.export.save(program, saved_model_path)
    inference_func = torch.export.load(saved_model_path).module()  # TF: loaded.signatures[DEFAULT_FUNCTION_KEY]
    predict_dataset = (batch[0] for batch in eval_dataset)
    for batch in predict_dataset:
        print(inference_func(batch).shape)
        break

    # Fine-tuning what was loaded. TF: hub.KerasLayer(loaded, trainable=True) over tf.saved_model.load.
    loaded = td.keras.models.load_model(keras_model_path).module  # outside the scope: a plain module
    with mirrored_strategy.scope():
        model = td.keras.Model(torch.nn.Sequential(loaded, torch.nn.Linear(10, 1)))  # TF: Dense(1)
        model.compile(loss=td.keras.losses.MeanSquaredError(), optimizer=td.keras.optimizers.Adam())
    regression = [(x, y.float()) for x, y in train_dataset]
    fine_tuned = model.fit(regression, epochs=epochs)
    return {"restored": restored.history, "restored_ds": restored_ds.history, "fine_tuned": fine_tuned.history}


# -- tutorials/distribute/parameter_server_training.ipynb: "Training with Model.fit" ------------------
def parameter_server_tutorial(workdir: str, epochs: int = 5) -> dict:
    NUM_WORKERS, NUM_PS = 3, 2
    cluster_resolver = td.ps.create_in_process_cluster(NUM_WORKERS, NUM_PS)
    variable_partitioner = td.partitioners.MinSizePartitioner(min_shard_bytes=(256 << 10), max_shards=NUM_PS)
    strategy = td.ParameterServerStrategy(cluster_resolver, variable_partitioner=variable_partitioner)

    global_batch_size = 64
    x = torch.rand((10, 10))
    y = torch.rand((10,))
    dataset = torch.utils.data.TensorDataset(x, y)  # TF: .shuffle(10).repeat().batch(global_batch_size)
    dataset = torch.utils.data.DataLoader(dataset, batch_size=global_batch_size, sampler=torch.utils.data.RandomSampler(
        dataset, replacement=True, num_samples=10 * global_batch_size))

    with strategy.scope():
        model = td.keras.Model(torch.nn.Sequential(torch.nn.Linear(10, 10)))  # TF: Dense(10): input size given
        model.compile(td.keras.optimizers.SGD(), loss="mse", steps_per_execution=10)

    working_dir = os.path.join(workdir, "my_working_dir")
    log_dir = os.path.join(working_dir, "log")
    ckpt_filepath = os.path.join(working_dir, "ckpt")
    backup_dir = os.path.join(working_dir, "backup")  # noqa: F841 - TF: BackupAndRestore: refused under PS here
    callbacks = [
        td.keras.callbacks.TensorBoard(log_dir=log_dir),
        td.keras.callbacks.ModelCheckpoint(filepath=ckpt_filepath),
    ]
    history = model.fit(dataset, epochs=epochs, steps_per_epoch=20, callbacks=callbacks)
    restored = td.keras.models.load_model(ckpt_filepath)  # the whole model ModelCheckpoint wrote
    return {"history": history.history, "restored_layers": len(restored.module)}


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "keras"
    with tempfile.TemporaryDirectory() as workdir:
        result = {"keras": keras_tutorial, "save_and_load": save_and_load_guide,
                  "parameter_server": parameter_server_tutorial}[which](workdir)
    print({k: v for k, v in result.items() if k != "history"})
