"""Security (docs/security.md): tampered checkpoints run nothing through any load path.

A checkpoint directory anyone could write (a shared filesystem, a download) must never run
code in the process that opens it: DCP's ``.metadata`` is a pickle, and its own reader
unpickles whatever it names. Each attack here would create a file if anything in the
tampered file ran; the test asserts the file is never created and the error names the file.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import torch_distribute as td
from torch_distribute import cli
from torch_distribute.checkpoint import CheckpointManager, file_io
from torch_distribute.checkpoint.sharded_io import CHECKSUMS_KEY, write_sharded

pytestmark = pytest.mark.timeout(120)


class _Payload:
    """Unpickling this runs ``os.system("touch <marker>")``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _Net(td.keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.dense(x)


def _sharded(path, model: torch.nn.Module) -> None:
    payload = {"format": td.checkpoint.FORMAT, "version": 1, "save_counter": 1,
               "objects": {"model": model.state_dict()}}
    write_sharded(str(path), payload, is_writer=True, barrier=lambda what: None)


def _rewrite_layout(directory, checksums: str) -> None:
    """Make ``layout.pt`` agree with the files as they are now (``"consistent"``), or drop its
    checksums (``"removed"``, as a checkpoint written before checksums existed)."""
    layout_path = directory / "layout.pt"
    layout = torch.load(layout_path, weights_only=True)
    if checksums == "removed":
        del layout[CHECKSUMS_KEY]
        torch.save(layout, layout_path)
        return
    layout[CHECKSUMS_KEY] = {name: list(file_io.file_fingerprint(str(directory / name)))
                             for name in layout[CHECKSUMS_KEY]}
    file_io.save_file(str(layout_path), layout)


def _load_paths(directory, checkpoint_path):
    """Every public way to load ``checkpoint_path`` (a checkpoint in ``directory``)."""
    def read():
        td.Checkpoint(model=torch.nn.Linear(3, 2)).read(checkpoint_path)

    def restore():
        td.Checkpoint(model=torch.nn.Linear(3, 2)).restore(checkpoint_path)

    def manager():
        CheckpointManager(td.Checkpoint(model=torch.nn.Linear(3, 2)), str(directory)).restore_or_initialize()

    def latest_then_restore():
        found = td.latest_checkpoint(directory)
        td.Checkpoint(model=torch.nn.Linear(3, 2)).restore(found)

    def load_weights():
        _Net().load_weights(str(checkpoint_path))

    def load_model():
        td.keras.models.load_model(checkpoint_path)

    def convert():
        code = cli.main(["checkpoint", "convert", str(checkpoint_path), str(directory / "plain.pt")])
        if code != 0:
            raise td.CheckpointError(f"convert exited {code}")
        raise AssertionError("convert accepted a tampered checkpoint")

    return {"read": read, "restore": restore, "restore_or_initialize": manager,
            "latest_checkpoint+restore": latest_then_restore, "load_weights": load_weights,
            "load_model": load_model, "checkpoint convert": convert}


@pytest.mark.parametrize("checksums", ["consistent", "removed"])
def test_tampered_dcp_metadata_runs_nothing_through_any_load_path(tmp_path, capsys, checksums):
    directory = tmp_path / "ckpts"
    checkpoint = directory / "ckpt-1"
    _sharded(checkpoint, torch.nn.Linear(3, 2))
    marker = tmp_path / "pwned"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    _rewrite_layout(checkpoint, checksums)
    for name, load in _load_paths(directory, checkpoint).items():
        with pytest.raises(td.CheckpointError) as caught:
            load()
        message = str(caught.value) + capsys.readouterr().err
        assert "ckpt-1/.metadata" in message and ".system, which is not" in message, (name, message)
        assert not marker.exists(), name


def test_tampered_layout_and_plain_file_run_nothing(tmp_path):
    """``layout.pt`` and plain checkpoint files load with ``weights_only``: torch's allowlist."""
    marker = tmp_path / "pwned"
    sharded = tmp_path / "sharded" / "ckpt-1"
    _sharded(sharded, torch.nn.Linear(3, 2))
    layout = torch.load(sharded / "layout.pt", weights_only=True)
    layout["objects"]["extra"] = _Payload(str(marker))
    file_io.save_file(str(sharded / "layout.pt"), layout)  # a valid checksum of its own
    plain = tmp_path / "plain" / "ckpt-1"
    os.makedirs(plain.parent)
    file_io.save_file(str(plain), {"format": td.checkpoint.FORMAT, "version": 1, "save_counter": 1,
                                   "objects": {"model": _Payload(str(marker))}})
    for path, name in ((sharded, "layout.pt"), (plain, "ckpt-1")):
        with pytest.raises(td.CheckpointError, match=f"{name}.*weights_only"):
            td.Checkpoint(model=torch.nn.Linear(3, 2)).restore(td.latest_checkpoint(path.parent))
        with pytest.raises(td.CheckpointError, match=name):
            CheckpointManager(td.Checkpoint(model=torch.nn.Linear(3, 2)), str(path.parent)).restore_or_initialize()
    assert not marker.exists()


def test_untampered_sharded_checkpoint_loads(tmp_path):
    model = torch.nn.Linear(3, 2)
    _sharded(tmp_path / "ckpt-1", model)
    fresh = torch.nn.Linear(3, 2)
    td.Checkpoint(model=fresh).read(tmp_path / "ckpt-1").assert_consumed()
    assert torch.equal(fresh.weight, model.weight)
