"""TensorFlow's "Distributed training with Keras" tutorial in its Keras 3 form, on torch.

Shared by ``tests/test_keras3.py`` (one process: one device, ``MirroredStrategy``,
``CentralStorageStrategy``, ``OneDeviceStrategy``) and ``tests/test_keras3_multiworker.py``
(its worker processes, under ``MultiWorkerMirroredStrategy``). As the tutorial (tensorflow/docs
site/en/tutorials/distribute/keras.ipynb) has it, with only the strategy line and the data
loading changed: small MNIST-shaped arrays made here (no download) instead of TFDS, fed to
``fit`` as arrays with the global batch size and no shuffling (so that N replicas and one
device see the same global batches), Keras 3 file names (``.weights.h5``, ``.keras``), and no
``TensorBoard`` callback (it imports TensorFlow). No pytest here: worker scripts import it.
"""

from __future__ import annotations

import os

os.environ["KERAS_BACKEND"] = "torch"  # before Keras is imported (it reads it once)
os.environ.setdefault("KERAS_TORCH_DEVICE", "cpu")  # CPU replicas, also where a GPU is present

import keras  # noqa: E402
import numpy as np  # noqa: E402

EPOCHS = 4
BATCH_SIZE_PER_REPLICA = 16
NUM_TRAIN, NUM_EVAL = 100, 40  # the last global batch is ragged


def mnist_like() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Train and eval images (uint8, 28x28x1) with labels 0..9 that depend on them."""
    rng = np.random.default_rng(7)
    images = rng.integers(0, 256, (NUM_TRAIN + NUM_EVAL, 28, 28, 1), dtype=np.uint8)
    labels = (images[:, 10:18, 10:18, 0].mean(axis=(1, 2)) // 25.6).astype(np.int64) % 10
    scaled = images.astype(np.float32) / 255  # the tutorial's `scale`
    return (scaled[:NUM_TRAIN], labels[:NUM_TRAIN]), (scaled[NUM_TRAIN:], labels[NUM_TRAIN:])


def decay(epoch: int) -> float:
    if epoch < 2:
        return 1e-3
    if epoch < 3:
        return 1e-4
    return 1e-5


def build_and_compile(input_shape: bool = True) -> keras.Model:
    """The tutorial's model; ``input_shape=False``: its first layer without one (the model has
    no weights until its first batch, which ``fit`` gives it)."""
    shape = {"input_shape": (28, 28, 1)} if input_shape else {}
    model = keras.Sequential([
        keras.layers.Conv2D(8, 3, activation="relu", **shape),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(), metrics=["accuracy"])
    return model


def run(strategy, workdir: str, num_replicas: int, extra_callbacks=(), verbose: int = 0,
        early_stopping: bool = False, input_shape: bool = True) -> dict:
    """The tutorial under ``strategy`` (``None``: one device, no strategy), with the global
    batch of ``num_replicas`` replicas; everything its steps produce, as plain values.

    ``early_stopping``: also an ``EarlyStopping`` that stops after the last epoch (whose loss
    improves by less than ``min_delta``) and restores the weights of the epoch before.
    ``input_shape=False``: the model's first layer has no input shape (``build_and_compile``)."""
    import contextlib

    (x_train, y_train), (x_eval, y_eval) = mnist_like()
    batch_size = BATCH_SIZE_PER_REPLICA * num_replicas
    keras.utils.set_random_seed(1)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = build_and_compile(input_shape)
        built_in_scope = model.built

    checkpoint_dir = os.path.join(workdir, "training_checkpoints")
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch}.weights.h5")
    learning_rates = []

    class PrintLR(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            learning_rate = float(model.optimizer.learning_rate.numpy())
            learning_rates.append(learning_rate)
            print(f"\nLearning rate for epoch {epoch + 1} is {learning_rate}")

    callbacks = [
        keras.callbacks.ModelCheckpoint(filepath=checkpoint_prefix, save_weights_only=True),
        keras.callbacks.LearningRateScheduler(decay),
        PrintLR(),
        *extra_callbacks,
    ]
    stopper = keras.callbacks.EarlyStopping(monitor="loss", min_delta=0.05, patience=0, restore_best_weights=True)
    if early_stopping:
        callbacks.append(stopper)
    history = model.fit(x_train, y_train, batch_size=batch_size, epochs=EPOCHS, callbacks=callbacks,
                        shuffle=False, verbose=verbose)
    weights = [w.tolist() for w in model.get_weights()]
    model.load_weights(os.path.join(checkpoint_dir, f"ckpt_{EPOCHS}.weights.h5"))
    evaluated = model.evaluate(x_eval, y_eval, batch_size=batch_size, verbose=0)
    predicted = model.predict(x_eval[:9], batch_size=4, verbose=0).tolist()

    path = os.path.join(workdir, "model.keras")
    if strategy is None or strategy.extended.should_checkpoint:
        model.save(path)
    out = {"weights": weights, "history": history.history, "evaluate": evaluated, "predict": predicted,
           "learning_rates": learning_rates, "optimizer_iterations": int(model.optimizer.iterations.numpy()),
           "stopped_epoch": stopper.stopped_epoch, "built_in_scope": built_in_scope,
           "served": strategy is not None and _served(model) is strategy}
    if strategy is None or strategy.extended.num_workers_in_sync == 1:
        unreplicated = keras.models.load_model(path)
        unreplicated.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                             optimizer=keras.optimizers.Adam(), metrics=["accuracy"])
        out["unreplicated_evaluate"] = unreplicated.evaluate(x_eval, y_eval, batch_size=batch_size, verbose=0)
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            replicated = keras.models.load_model(path)
            replicated.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                               optimizer=keras.optimizers.Adam(), metrics=["accuracy"])
            out["replicated_evaluate"] = replicated.evaluate(x_eval, y_eval, batch_size=batch_size, verbose=0)
        out["replicated_served"] = strategy is not None and _served(replicated) is strategy
    return out


def _served(model):
    import torch_distribute as td

    return td.keras3.served_by(model)
