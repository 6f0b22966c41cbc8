"""The Keras-style programs: image folders, MobileNetV2, the linear regression (Keras and Estimator)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

import torch_distribute as td

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from examples import keras_fit_linear, keras_fit_mobilenet  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def _write_image_folders(root, per_class=(6, 4), size=(20, 30)):
    from PIL import Image

    rng = np.random.default_rng(0)
    for name, count in zip(("cats", "dogs"), per_class, strict=True):
        (root / name).mkdir(parents=True)
        for i in range(count):
            pixels = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    (root / "cats" / "notes.txt").write_text("not an image")


def test_image_dataset_from_directory(tmp_path):
    _write_image_folders(tmp_path)
    ds = td.keras.preprocessing.image_dataset_from_directory(tmp_path, image_size=(8, 12), batch_size=4, seed=1)
    assert ds.class_names == ["cats", "dogs"] and len(ds.file_paths) == 10 and len(ds) == 3
    batches = list(ds)
    images, labels = batches[0]
    assert images.shape == (4, 3, 8, 12) and images.dtype == torch.float32 and labels.dtype == torch.int64
    assert 0 <= float(images.min()) and float(images.max()) <= 255
    assert sorted(torch.cat([b[1] for b in batches]).tolist()) == [0] * 6 + [1] * 4
    train, val = td.keras.preprocessing.image_dataset_from_directory(
        tmp_path, image_size=(8, 8), batch_size=4, seed=1, validation_split=0.2, subset="both",
        label_mode="categorical")
    assert len(train.file_paths) == 8 and len(val.file_paths) == 2
    assert not set(train.file_paths) & set(val.file_paths)
    assert next(iter(val))[1].shape == (2, 2)
    with pytest.raises(td.InvalidArgumentError, match="validation_split and subset go together"):
        td.keras.preprocessing.image_dataset_from_directory(tmp_path, validation_split=0.2)


def test_mobilenet_v2_widths_and_shapes():
    model = td.keras.applications.MobileNetV2(input_shape=(3, 32, 32), alpha=0.35, classes=2)
    out = model(torch.rand(3, 3, 32, 32))
    assert out.shape == (3, 2) and torch.allclose(out.sum(1), torch.ones(3))  # softmax
    full = td.keras.applications.MobileNetV2(classes=1000, classifier_activation=None)
    assert sum(p.numel() for p in full.parameters()) == 3_504_872  # Keras' MobileNetV2(alpha=1.0) count
    features = td.keras.applications.MobileNetV2(include_top=False, pooling="avg", alpha=0.5)
    assert features(torch.rand(1, 3, 64, 64)).shape == (1, 1280)
    with pytest.raises(td.InvalidArgumentError, match="download"):
        td.keras.applications.MobileNetV2(weights="imagenet")


def test_mobilenet_example_on_image_folders_with_two_replicas(tmp_path, capsys):
    data = tmp_path / "data"
    _write_image_folders(data, per_class=(25, 25), size=(40, 40))  # 40 training images: 4 rows a replica
    result = keras_fit_mobilenet.main([
        "--strategy", "mirrored", "--devices", "cpu:0,cpu:1", "--data-dir", str(data), "--image-size", "32",
        "--alpha", "0.35", "--epochs", "2", "--batch-size-per-replica", "4", "--steps-per-epoch", "2",
        "--output-dir", str(tmp_path / "out"), "--verbose", "2"])
    out = capsys.readouterr().out
    assert "Number of devices: 2" in out and "40 training and 10 validation images" in out
    assert "Epoch 2/2" in out and "val_accuracy" in out
    assert 0.0 <= result["accuracy"] <= 1.0
    assert (tmp_path / "out" / "training.csv").exists()
    assert any(name.startswith("ckpt-") for name in os.listdir(tmp_path / "out"))


def test_mobilenet_example_default_data_is_written_from_sklearn_photos(tmp_path):
    folder = keras_fit_mobilenet.write_sample_crops(str(tmp_path / "crops"), per_class=3, seed=0)
    assert sorted(os.listdir(folder)) == ["china", "flower"]
    assert sorted(os.listdir(os.path.join(folder, "china"))) == ["0000.jpg", "0001.jpg", "0002.jpg"]


def test_linear_programs_keras_and_estimator(tmp_path, capsys):
    result = keras_fit_linear.main(["--strategy", "mirrored", "--devices", "cpu:0,cpu:1", "--verbose", "0",
                                    "--model-dir", str(tmp_path)])
    keras, estimator = result["keras"], result["estimator"]
    assert keras["eval_loss"] < 1e-4 and keras["weight"] + keras["bias"] == pytest.approx(1.0, abs=1e-2)
    assert estimator["global_step"] == 10 and estimator["average_loss"] < 1e-6
    assert estimator["weight"] + estimator["bias"] == pytest.approx(1.0, abs=1e-3)
    out = capsys.readouterr().out
    assert "Keras: loss" in out and "LinearRegressor: average_loss" in out
    torch.manual_seed(0)  # as main() does: the same initial weights
    one = keras_fit_linear.run_keras(td.OneDeviceStrategy("cpu"), verbose=0)
    assert one["weight"] == pytest.approx(keras["weight"], abs=1e-5)


def test_tensorflow_keras_tutorial_and_save_and_load_guide_ports_run_to_the_end(tmp_path):
    """examples/tf_tutorials.py: TensorFlow's Keras tutorial and save-and-load guide, ported
    mechanically, run to the end (small synthetic MNIST) with their own checks."""
    from examples import tf_tutorials

    keras = tf_tutorials.keras_tutorial(os.fspath(tmp_path / "keras"), num_train=256, num_test=64, epochs=4)
    assert keras["history"]["loss"][-1] < keras["history"]["loss"][0]
    # The model loaded outside the scope and the one loaded in it evaluate as the trained one.
    np.testing.assert_allclose(keras["unreplicated"], keras["eval"], rtol=1e-5)
    np.testing.assert_allclose(keras["replicated"], keras["eval"], rtol=1e-5)
    guide = tf_tutorials.save_and_load_guide(os.fspath(tmp_path / "guide"), num_train=256, epochs=2)
    # Loaded outside any scope and under another strategy, the model trains on alike.
    np.testing.assert_allclose(guide["restored_ds"]["loss"], guide["restored"]["loss"], rtol=2e-2)  # other shuffles
    assert guide["fine_tuned"]["loss"][-1] < guide["fine_tuned"]["loss"][0]
