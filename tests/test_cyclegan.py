"""The CycleGAN example: per-sample loss scaling, the data, and 1 vs 2 replicas vs 2 workers.

Tiny networks (16x16 images, 4 filters, 1 residual block) and a couple of steps per run keep
the file fast on a busy 2-core machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch_distribute as td  # noqa: E402
from examples.cyclegan import data, train  # noqa: E402
from examples.cyclegan.models import ModelConfig  # noqa: E402
from examples.cyclegan.steps import (  # noqa: E402
    LOSS_KEYS,
    MAE_KEYS,
    build_cyclegan,
    make_test_step,
    make_train_step,
    per_sample_losses,
    reduce_dict,
)

REPO = Path(__file__).resolve().parents[1]
TINY = ModelConfig(image_size=16, generator_filters=4, residual_blocks=1,
                   discriminator_filters=4, discriminator_layers=2)
TINY_FLAGS = [
    "--image-size", "16", "--generator-filters", "4", "--residual-blocks", "1",
    "--discriminator-filters", "4", "--discriminator-layers", "2", "--no-progress",
]


def _images(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _relative_error(reference: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """The largest difference between two gradients, relative to the reference's largest entry."""
    return max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(reference, other, strict=True))


def _max_parameter_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p.detach().cpu() - q.detach().cpu()).abs().max())
               for p, q in zip(a.parameters(), b.parameters(), strict=True))


# -- losses ------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_every_loss_is_per_sample():
    torch.manual_seed(0)
    gan = build_cyclegan(TINY)
    for gan_loss in ("lsgan", "bce"):
        losses = per_sample_losses(gan, _images(3, 1), _images(3, 2), gan_loss=gan_loss)
        assert set(losses) == set(LOSS_KEYS) | set(MAE_KEYS)
        for key, value in losses.items():
            assert value.shape == (3,), key
        # The total is the tutorial's sum; the cycle loss (both directions) is shared.
        torch.testing.assert_close(
            losses["loss_G/total"],
            losses["loss_G/loss"] + losses["loss_G/cycle"] + losses["loss_G/identity"])
        assert torch.equal(losses["loss_G/cycle"], losses["loss_F/cycle"])


def _generator_gradient(strategy: td.Strategy, x: torch.Tensor, y: torch.Tensor,
                        scaling: str) -> list[torch.Tensor]:
    """The gradient of G's total loss summed over replicas, as the optimizer step sees it."""
    torch.manual_seed(0)
    with strategy.scope():
        gan = build_cyclegan(TINY)
        optimizer = torch.optim.SGD(gan.generator_g.parameters(), lr=0.0)
    global_batch = len(x)

    def step(real_x: torch.Tensor, real_y: torch.Tensor) -> None:
        per_sample = per_sample_losses(gan, real_x, real_y)["loss_G/total"]
        if scaling == "global":
            loss = td.compute_average_loss(per_sample, global_batch_size=global_batch)
        else:  # the seed's warning case: this replica's own mean
            loss = per_sample.mean()
        loss.backward(inputs=list(gan.generator_g.parameters()))
        optimizer.step()  # sums the replicas' gradients into replica 0's .grad

    for batch_x, batch_y in strategy.experimental_distribute_dataset([(x, y)]):
        strategy.run(step, args=(batch_x, batch_y))
    return [p.grad.detach().clone() for p in gan.generator_g.parameters()]


@pytest.mark.timeout(60)
def test_per_sample_losses_over_the_global_batch_give_one_devices_gradient():
    one = td.OneDeviceStrategy("cpu")
    two = td.MirroredStrategy(["cpu:0", "cpu:1"])
    x, y = _images(5, 1), _images(5, 2)  # a ragged batch: 3 + 2 samples on the replicas

    reference = _generator_gradient(one, x, y, "global")
    distributed = _generator_gradient(two, x, y, "global")
    assert _relative_error(reference, distributed) < 1e-5  # float32 rounding only

    # A plain mean per replica is refused before any gradient is computed...
    with pytest.raises(td.LossScalingError, match="compute_average_loss"):
        _generator_gradient(two, x, y, "plain")
    # ...and, turned off knowingly, weighs 2 samples like 3 and counts the batch twice.
    two.set_loss_scaling_check(False)
    plain = _generator_gradient(two, x, y, "plain")
    assert _relative_error(reference, plain) > 0.1

    # Even with equal halves it is scaled wrongly: the sum of 2 means is twice the mean.
    x4, y4 = x[:4], y[:4]
    reference4 = _generator_gradient(one, x4, y4, "global")
    plain4 = _generator_gradient(two, x4, y4, "plain")
    assert _relative_error([2 * g for g in reference4], plain4) < 1e-5


@pytest.mark.timeout(60)
def test_train_and_test_steps_agree_on_1_and_2_replicas():
    """Four optimizers stepping in one run: parameters and reduced losses as on one device."""
    x, y = _images(4, 3), _images(4, 4)
    results = []
    for strategy in (td.OneDeviceStrategy("cpu"), td.MirroredStrategy(["cpu:0", "cpu:1"])):
        torch.manual_seed(0)
        with strategy.scope():
            gan = build_cyclegan(TINY)
        train_step, test_step = make_train_step(gan, global_batch_size=4), make_test_step(gan)
        losses = []
        for bx, by in strategy.experimental_distribute_dataset([(x, y), (y, x)]):
            per_replica = strategy.run(train_step, args=(bx, by))
            assert set(per_replica) == set(LOSS_KEYS)
            losses.append(reduce_dict(strategy, per_replica))
        # One sample: replica 1 gets an empty batch and still takes the four optimizer steps.
        single_step = make_train_step(gan, global_batch_size=1)
        for bx, by in strategy.experimental_distribute_dataset([(x[:1], y[:1])]):
            losses.append(reduce_dict(strategy, strategy.run(single_step, args=(bx, by))))
        for size in (3, 1):  # 2 + 1 samples, then 1 + 0
            for bx, by in strategy.experimental_distribute_dataset([(x[:size], y[:size])]):
                losses.append(reduce_dict(strategy, strategy.run(test_step, args=(bx, by, size))))
        results.append((gan, losses))
    (gan1, losses1), (gan2, losses2) = results
    for name, model in gan1.models().items():
        assert _max_parameter_difference(model, gan2.models()[name]) < 1e-5, name
    for a, b in zip(losses1, losses2, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    assert set(losses1[-1]) == set(LOSS_KEYS) | set(MAE_KEYS)


# -- data --------------------------------------------------------------------------------------
def _write_images(folder: Path, count: int, size: tuple[int, int], colour: tuple[int, int, int],
                  some_grey: bool = False) -> None:
    from PIL import Image

    folder.mkdir(parents=True)
    for i in range(count):
        pixels = np.zeros((size[1], size[0], 3), dtype=np.uint8)
        pixels[..., :] = colour
        pixels[: size[1] // 2, : size[0] // 2] = 255 - i  # a bright top-left quarter
        mode = "L" if some_grey and i % 2 else "RGB"  # greyscale files are converted to RGB
        image = Image.fromarray(pixels).convert(mode)
        image.save(folder / (f"img{i}.png" if i % 3 else f"img{i}.jpg"))
    (folder / "notes.txt").write_text("not an image")


@pytest.fixture
def cyclegan_folder(tmp_path: Path) -> Path:
    root = tmp_path / "tiny2zebra"
    _write_images(root / "trainA", 6, (20, 24), (200, 30, 30), some_grey=True)
    _write_images(root / "trainB", 9, (24, 24), (30, 30, 200))
    _write_images(root / "testA", 3, (16, 16), (200, 30, 30))
    _write_images(root / "testB", 2, (16, 16), (30, 30, 200))
    return root


@pytest.mark.timeout(30)
def test_folder_loader_reads_trims_and_jitters(cyclegan_folder: Path):
    domains = data.folder_domains(cyclegan_folder, image_size=16)
    assert (len(domains.train_x), len(domains.train_y)) == (6, 9)  # notes.txt ignored
    assert "trainA/trainB/testA/testB: 6/9/3/2" in domains.description

    train_set = data.UnpairedImages(domains.train_x, domains.train_y, train=True, seed=1)
    assert len(train_set) == 6  # trimmed to the shorter domain before zipping
    x, y = train_set[0]
    assert x.shape == y.shape == (3, 16, 16) and x.dtype == torch.float32
    assert -1.0 <= float(x.min()) and float(x.max()) <= 1.0
    assert float(y[2].mean()) > float(y[0].mean())  # domain B is blue

    # Deterministic per (seed, epoch, index): the same in every process and every run ...
    again = data.UnpairedImages(domains.train_x, domains.train_y, train=True, seed=1)
    for epoch in (0, 3):
        train_set.set_epoch(epoch)
        again.set_epoch(epoch)
        for i in range(len(train_set)):
            assert all(torch.equal(a, b) for a, b in zip(train_set[i], again[i], strict=True))
    # ... and a new subset, order and jitter every epoch.
    first = torch.stack([train_set[i][1] for i in range(6)])
    train_set.set_epoch(4)
    assert not torch.equal(first, torch.stack([train_set[i][1] for i in range(6)]))

    loader = data.make_loader(train_set, global_batch_size=4, train=True)
    assert [len(bx) for bx, _ in loader] == [4]  # the partial batch is dropped
    test_set = data.UnpairedImages(domains.test_x, domains.test_y, train=False)
    assert [len(bx) for bx, _ in data.make_loader(test_set, 4, train=False)] == [2]
    plot_x, plot_y = data.plot_batch(test_set, 5)
    assert plot_x.shape == plot_y.shape == (2, 3, 16, 16)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        data.make_loader(train_set, global_batch_size=8, train=True)


@pytest.mark.timeout(30)
def test_jitter_keeps_the_size_and_mirrors():
    image = torch.arange(3 * 8 * 8, dtype=torch.float32).reshape(3, 8, 8)
    outputs = [data.random_jitter(image, torch.Generator().manual_seed(s), scale=1.0) for s in range(20)]
    assert all(o.shape == image.shape for o in outputs)
    assert any(torch.equal(o, image) for o in outputs)
    assert any(torch.equal(o, image.flip(-1)) for o in outputs)


@pytest.mark.timeout(30)
def test_packaged_digits_are_two_deterministic_distinct_domains():
    a, b = data.digits_domains(16), data.digits_domains(16)
    assert torch.equal(a.train_x.images, b.train_x.images)
    assert torch.equal(a.test_y.images, b.test_y.images)
    x, y = a.train_x.images.float(), a.train_y.images.float()
    assert torch.equal(x[:, 0], x[:, 2])  # X is grey
    assert float((y[:, 2] - y[:, 0] > 40).float().mean()) > 0.2  # blue stripes behind
    assert float((y[:, 0] - y[:, 2] > 100).float().mean()) > 0.1  # orange strokes
    assert len(a.train_x) + len(a.train_y) + len(a.test_x) + len(a.test_y) == 1797


@pytest.mark.timeout(30)
def test_bad_command_lines_name_what_to_change(tmp_path: Path, capsys):
    (tmp_path / "trainA").mkdir()
    with pytest.raises(SystemExit):
        train.parse_args(["--data-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert "trainB" in err and "testA" in err
    with pytest.raises(SystemExit):
        train.parse_args(["--data-dir", str(tmp_path / "absent")])
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.parse_args(["--image-size", "30"])
    assert "multiple of 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.parse_args(["--image-size", "16", "--discriminator-layers", "3"])
    assert "--discriminator-layers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.parse_args(["--batch-size-per-replica", "0"])
    assert "positive integer" in capsys.readouterr().err


# -- the training program --------------------------------------------------------------------
def _train(tmp_path: Path, name: str, *flags: str) -> train.TrainResult:
    return train.main([*TINY_FLAGS, "--output-dir", str(tmp_path / name), "--steps-per-epoch", "2",
                       "--test-steps", "1", *flags])


@pytest.mark.timeout(120)
def test_one_device_and_two_replicas_train_the_same_parameters(tmp_path: Path, capsys):
    one = _train(tmp_path, "one", "--strategy", "one", "--devices", "cpu",
                 "--batch-size-per-replica", "4", "--epochs", "1")
    two = _train(tmp_path, "two", "--strategy", "mirrored", "--devices", "cpu:0,cpu:1",
                 "--batch-size-per-replica", "2", "--epochs", "1")
    out = capsys.readouterr().out
    assert "Number of devices: 1" in out and "Number of devices: 2" in out
    assert out.count("MAE(X, F(G(X))): ") == 2 and out.count("Elapse: ") == 2
    assert len(one.steps) == len(two.steps) == 2
    for name, model in one.gan.models().items():
        assert _max_parameter_difference(model, two.gan.models()[name]) < 1e-5, name
    for a, b in zip(one.steps + one.epochs, two.steps + two.epochs, strict=True):
        for key in a:
            if key != "seconds":
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), key


@pytest.mark.timeout(120)
def test_checkpoints_resume_where_they_stopped(tmp_path: Path, capsys):
    straight = _train(tmp_path, "straight", "--strategy", "one", "--devices", "cpu",
                      "--batch-size-per-replica", "4", "--epochs", "2", "--plot-every", "2")
    _train(tmp_path, "resumed", "--strategy", "one", "--devices", "cpu",
           "--batch-size-per-replica", "4", "--epochs", "1")
    resumed = _train(tmp_path, "resumed", "--strategy", "mirrored", "--devices", "cpu:0,cpu:1",
                     "--batch-size-per-replica", "2", "--epochs", "2", "--resume")
    assert "Resumed from" in capsys.readouterr().out and resumed.start_epoch == 1
    for name, model in straight.gan.models().items():
        assert _max_parameter_difference(model, resumed.gan.models()[name]) < 1e-5, name

    out = tmp_path / "straight"
    assert sorted(os.listdir(out / "checkpoints")) == ["checkpoint", "ckpt-1", "ckpt-2"]
    assert sorted(os.listdir(out / "images")) == ["epoch_002.png", "loss_curves.png"]
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(out / "tensorboard"))
    # The checkpoint holds all eight objects and the epoch, and loads with no strategy.
    fresh = build_cyclegan(TINY)
    epoch = torch.zeros((), dtype=torch.int64)
    fresh.checkpoint(epoch=epoch).read(td.latest_checkpoint(out / "checkpoints")).assert_consumed()
    assert int(epoch) == 2
    assert _max_parameter_difference(fresh.generator_g, straight.gan.generator_g) == 0.0


# The smallest networks the options allow: compilation, not arithmetic, is what costs here.
COMPILE_FLAGS = [
    "--image-size", "8", "--generator-filters", "2", "--residual-blocks", "0",
    "--discriminator-filters", "2", "--discriminator-layers", "1", "--no-progress",
    "--batch-size-per-replica", "2", "--epochs", "1", "--steps-per-epoch", "2", "--test-steps", "1",
]


@pytest.mark.slow
@pytest.mark.timeout(600)  # ~15 s with inductor's cache warm; cold on 2 busy cores: 3-6 minutes
def test_compiled_steps_train_what_eager_trains(tmp_path: Path, capsys):
    """``--compile`` (td.function on the distributed train and test steps, the tutorial's
    @tf.function) gives eager's parameters and losses; the two replicas share their graphs
    (test_compile.py counts them).

    Two CPU replicas only: the example's compile path is the same for every strategy, and
    td.function on one device is checked in test_compile.py (a cold compile of these graphs
    costs minutes of CPU on the 2-core CI machine)."""
    strategy_flags = ["--strategy", "mirrored", "--devices", "cpu:0,cpu:1"]
    torch._dynamo.reset()
    try:
        eager = train.main([*COMPILE_FLAGS, *strategy_flags, "--output-dir", str(tmp_path / "eager")])
        compiled = train.main([*COMPILE_FLAGS, *strategy_flags, "--output-dir", str(tmp_path / "compiled"),
                               "--compile"])
    finally:
        torch._dynamo.reset()
    assert "td.function graphs compiled: " in capsys.readouterr().out
    assert eager.tracing_counts == {}
    assert compiled.tracing_counts["train"] >= 1 and compiled.tracing_counts["test"] >= 1
    for name, model in eager.gan.models().items():
        assert _max_parameter_difference(model, compiled.gan.models()[name]) < 1e-5, name
    assert len(eager.steps) == len(compiled.steps) == 2
    for a, b in zip(eager.steps + eager.epochs, compiled.steps + compiled.epochs, strict=True):
        for key in a:
            if key != "seconds":
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), key


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")
@pytest.mark.timeout(240)
def test_two_workers_train_what_one_device_trains(tmp_path: Path, capsys):
    env = {k: v for k, v in os.environ.items()
           if k not in ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "torch_distribute.launch", "--nproc", "2", "-m",
               "examples.cyclegan.train", "--strategy", "multiworker", *TINY_FLAGS,
               "--batch-size-per-replica", "2", "--epochs", "1", "--steps-per-epoch", "2",
               "--test-steps", "1", "--output-dir", str(tmp_path / "mw")]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        output = proc.stdout.read() if proc.stdout else ""
        pytest.fail(f"the 2-worker run did not finish in 200 s:\n{output[-3000:]}")
    finally:
        _kill_group(proc)
    assert proc.returncode == 0, output[-3000:]
    assert "Number of devices: 2" in output
    assert output.count("MAE(X, F(G(X))): ") == 1  # the chief alone prints
    assert sorted(os.listdir(tmp_path / "mw" / "checkpoints")) == ["checkpoint", "ckpt-1"]

    one = _train(tmp_path, "one", "--strategy", "one", "--devices", "cpu",
                 "--batch-size-per-replica", "4", "--epochs", "1")
    capsys.readouterr()
    workers = build_cyclegan(TINY)
    workers.checkpoint(epoch=torch.zeros((), dtype=torch.int64)).read(
        td.latest_checkpoint(tmp_path / "mw" / "checkpoints")).assert_consumed()
    for name, model in one.gan.models().items():
        assert _max_parameter_difference(model, workers.models()[name]) < 1e-5, name
