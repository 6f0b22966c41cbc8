"""One worker of ``tests/test_collective_saves.py``: every save pattern under
MultiWorkerMirroredStrategy (2 workers, CPU, Gloo); prints one ``MWRESULT {json}`` line.

    python collective_saves_job.py DIR

The chief's ``torch.save`` is slowed down (``SLOW_SAVE_S``), so a worker that returned
before the chief's file is complete would find no file, or the previous one. Each section
runs on every worker and records what it saw right after the save returned (does the file
exist, which parameters does a restore give); an exception is recorded instead of ending the
job, so one broken pattern does not hide the others.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mw_helpers as H  # noqa: E402

import torch_distribute as td  # noqa: E402

SLOW_SAVE_S = 0.6

torch.set_num_threads(1)
directory = sys.argv[1]
strategy = td.MultiWorkerMirroredStrategy(communication_options=td.CommunicationOptions(timeout_seconds=30))
rank = strategy.extended.worker_index
chief = strategy.extended.should_checkpoint
result: dict = {"rank": rank, "errors": {}}

if chief:
    _real_save = torch.save

    def _slow_save(*args, **kwargs):
        time.sleep(SLOW_SAVE_S)
        return _real_save(*args, **kwargs)

    torch.save = _slow_save


def section(name):
    def wrap(fn):
        try:
            result[name] = fn()
        except Exception as error:  # noqa: BLE001 - reported to the test
            result["errors"][name] = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
            if isinstance(error, td.WorkerUnavailableError):
                H.emit(result)
                os._exit(1)
        return fn
    return wrap


torch.manual_seed(H.worker_seed(rank))  # the chief's initial values win
with strategy.scope():
    model = H.make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=H.LR)
x, y = H.make_data()


def train(steps: int) -> None:
    def step(batch):
        xb, yb = batch
        loss = td.compute_average_loss(F.cross_entropy(model(xb), yb, reduction="none"), global_batch_size=H.GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    for i, batch in enumerate(strategy.experimental_distribute_dataset(H.make_loader(x, y))):
        if i == steps:
            break
        strategy.run(step, args=(batch,))


def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1000 + rank)
    with strategy.scope():
        other = H.make_model()
        other_optimizer = torch.optim.Adam(other.parameters(), lr=H.LR)
    return other, other_optimizer


@section("save_then_restore_latest")
def _save_then_restore_latest():
    """Checkpoint.save, then every worker restores td.latest_checkpoint at once."""
    out = []
    ckpt = td.Checkpoint(model=model, optimizer=optimizer)
    for _ in range(2):
        train(2)
        path = ckpt.save(os.path.join(directory, "shared", "ckpt"))
        exists = os.path.isfile(path)
        latest = td.latest_checkpoint(os.path.join(directory, "shared"))
        other, other_optimizer = fresh()
        td.Checkpoint(model=other, optimizer=other_optimizer).restore(latest).assert_consumed()
        out.append({"path": path, "exists": exists, "latest": latest, "trained": H.flat(model),
                    "restored": H.flat(other)})
    return out


@section("write_then_read")
def _write_then_read():
    train(1)
    path = td.Checkpoint(model=model).write(os.path.join(directory, "shared", "weights.pt"))
    exists = os.path.isfile(path)
    other, _ = fresh()
    td.Checkpoint(model=other).read(path).assert_consumed()
    return {"path": path, "exists": exists, "trained": H.flat(model), "restored": H.flat(other)}


@section("manager_save_then_restore")
def _manager_save_then_restore():
    manager = td.CheckpointManager(td.Checkpoint(model=model, optimizer=optimizer),
                                   os.path.join(directory, "managed"), max_to_keep=2)
    out = []
    for _ in range(3):
        train(1)
        path = manager.save()
        out.append({"path": path, "exists": os.path.isfile(path)})
    other, other_optimizer = fresh()
    restored = td.CheckpointManager(td.Checkpoint(model=other, optimizer=other_optimizer),
                                    os.path.join(directory, "managed")).restore_or_initialize()
    return {"saves": out, "restored_path": restored, "trained": H.flat(model), "restored": H.flat(other)}


@section("tutorial_write_filepath")
def _tutorial_write_filepath():
    """TF's multi-worker tutorial: a non-chief saves into a temporary directory of its own
    with its own CheckpointManager, then deletes that directory."""
    checkpoint_dir = os.path.join(directory, "tutorial")
    write_dir = checkpoint_dir if chief else tempfile.mkdtemp(prefix=f"worker{rank}-", dir=directory)
    manager = td.CheckpointManager(td.Checkpoint(model=model), write_dir, max_to_keep=2)
    saves = []
    for _ in range(3):
        train(1)
        path = manager.save()
        saves.append({"path": path, "exists": os.path.isfile(path)})
    listing = sorted(os.listdir(write_dir))
    latest_here = td.latest_checkpoint(write_dir)
    if not chief:
        shutil.rmtree(write_dir)  # the tutorial's cleanup: must find the directory
    other, _ = fresh()
    td.Checkpoint(model=other).restore(td.latest_checkpoint(checkpoint_dir)).expect_partial()
    return {"saves": saves, "listing": listing, "latest_here": latest_here, "write_dir": write_dir,
            "cleaned": not os.path.exists(write_dir), "trained": H.flat(model), "restored": H.flat(other)}


@section("keras_best_then_load")
def _keras_best_then_load():
    torch.manual_seed(H.worker_seed(rank))
    with strategy.scope():
        keras_model = td.keras.Model(H.make_model())
    keras_model.compile(td.keras.optimizers.Adam(learning_rate=0.05),
                        td.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    best = os.path.join(directory, "keras", "best.pt")
    callback = td.keras.callbacks.ModelCheckpoint(best, monitor="loss", save_best_only=True)
    keras_model.fit(x, y, batch_size=8, epochs=3, callbacks=[callback], verbose=0)
    exists = os.path.isfile(best)
    final = H.flat(keras_model)
    keras_model.load_weights(best)
    loaded = H.flat(keras_model)
    saved = keras_model.save_weights(os.path.join(directory, "keras", "last.pt"))
    return {"exists": exists, "saved": callback.saved, "final": final, "loaded": loaded,
            "save_weights_exists": os.path.isfile(saved)}


@section("backup_and_restore")
def _backup_and_restore():
    backup_dir = os.path.join(directory, "backup")
    backup = td.BackupAndRestore(td.Checkpoint(model=model, optimizer=optimizer), backup_dir,
                                 save_freq=2, delete_checkpoint=False)
    seen = []
    for _ in backup.epochs(1):
        for _batch in backup.steps([0] * 6):
            if backup.global_step in (2, 4):  # the step right after a backup
                seen.append(td.latest_checkpoint(backup_dir))
            train(1)
    return {"seen": seen, "latest": td.latest_checkpoint(backup_dir)}


@section("chief_fails")
def _chief_fails():
    blocker = os.path.join(directory, "blocker")
    if chief:
        with open(blocker, "w") as f:
            f.write("a file where the chief wants a directory")
    strategy.extended.all_gather_objects(None, what="blocker made")
    try:
        td.Checkpoint(model=model).save(os.path.join(blocker, "ckpt"))
    except td.CheckpointError as error:
        raised = f"{type(error).__name__}: {error}"
    else:
        raised = None
    # The workers are still in step: the next collective save works.
    after = td.Checkpoint(model=model).write(os.path.join(directory, "after_failure.pt"))
    return {"raised": raised, "after_exists": os.path.isfile(after)}


H.emit(result)
