"""Checkpoint integrity in one process: checksums, truncation, damaged bytes, index entries
outside the directory, the fallback to the newest intact checkpoint, stale temporary files.

Every kind of damage must raise ``td.CheckpointError`` naming the file and what is wrong;
files written before checksums existed must still load without an error.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
import warnings
import zipfile

import pytest
import torch
from torch import nn

import torch_distribute as td
from torch_distribute.checkpoint import CheckpointManager, CorruptCheckpointError, file_io
from torch_distribute.checkpoint.sharded_io import CHECKSUMS_KEY, write_sharded

# A tensor whose bytes are easy to find in the file.
MARKER = torch.arange(1000, 1064, dtype=torch.float32)


def _objects(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer, MARKER.clone()


def _write(path) -> str:
    model, optimizer, marker = _objects()
    return td.Checkpoint(model=model, optimizer=optimizer, marker=marker).write(path)


def _read(path) -> None:
    model, optimizer, marker = _objects(seed=1)
    td.Checkpoint(model=model, optimizer=optimizer, marker=marker).read(path)


def _flip(path, offset: int) -> None:
    data = bytearray(open(path, "rb").read())
    data[offset] ^= 0x10
    open(path, "wb").write(bytes(data))


def _central_directory(path) -> tuple[int, int]:
    """(offset, size) of the zip central directory of ``path``."""
    data = open(path, "rb").read()
    eocd = data.rfind(b"PK\x05\x06")
    size, offset = struct.unpack("<II", data[eocd + 12:eocd + 20])
    return offset, size


# -- the file format ---------------------------------------------------------------------------
def test_a_file_carries_its_checksum_and_stays_a_plain_torch_file(tmp_path):
    path = _write(tmp_path / "c.pt")
    digest = file_io.read_checksum(path)
    assert digest is not None and len(digest) == 64
    assert zipfile.ZipFile(path).comment == b"torch-distribute:sha256:" + digest.encode()
    payload = torch.load(path, weights_only=True)  # still an ordinary torch.save archive
    assert torch.equal(payload["objects"]["marker"], MARKER)
    _read(path)


# -- every kind of damage raises CheckpointError naming the file -------------------------------
def _truncations(size: int) -> list[int]:
    return sorted({0, 1, 3, 10, 100, size // 3, size // 2, size - 300, size - 111, size - 110,
                   size - 89, size - 88, size - 50, size - 2, size - 1})


def test_truncation_at_any_offset_is_refused(tmp_path):
    path = _write(tmp_path / "c.pt")
    data = open(path, "rb").read()
    for cut in _truncations(len(data)):
        open(path, "wb").write(data[:cut])
        with pytest.raises(td.CheckpointError, match="truncated") as info:
            _read(path)
        assert isinstance(info.value, CorruptCheckpointError), cut
        assert str(path) in str(info.value), cut
        with pytest.raises(CorruptCheckpointError):  # the cheap check catches it too
            file_io.check_file(path, full=False)


def test_one_flipped_byte_in_tensor_data_is_a_checksum_mismatch(tmp_path):
    path = _write(tmp_path / "c.pt")
    offset = open(path, "rb").read().find(MARKER.numpy().tobytes())
    assert offset > 0
    _flip(path, offset + 5)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch: the file is damaged"):
        _read(path)


def test_the_same_flip_in_a_file_without_checksum_would_load_changed_values(tmp_path):
    """Why the checksum exists: torch.load does not notice (zip CRCs are not checked)."""
    model, optimizer, marker = _objects()
    path = tmp_path / "old.pt"
    torch.save({"format": td.checkpoint.FORMAT, "version": 1, "save_counter": 0,
                "objects": {"marker": marker}}, path)
    _flip(path, open(path, "rb").read().find(MARKER.numpy().tobytes()) + 5)
    target = torch.zeros(64)
    td.Checkpoint(marker=target).read(path)
    assert not torch.equal(target, MARKER)


@pytest.mark.parametrize("where", ["crc", "name", "offset", "count"])
def test_a_flipped_byte_in_the_zip_directory_is_refused(tmp_path, where):
    path = _write(tmp_path / "c.pt")
    offset, size = _central_directory(path)
    delta = {"crc": 16, "name": 50, "offset": 43, "count": None}[where]
    if delta is None:  # the entry count in the end-of-archive record
        offset, delta = open(path, "rb").read().rfind(b"PK\x05\x06"), 8
    _flip(path, offset + delta)
    with pytest.raises(CorruptCheckpointError, match="damaged") as info:
        _read(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("where", ["header", "pickle", "checksum", "magic", "comment_length"])
def test_other_flipped_bytes_are_refused(tmp_path, where):
    path = _write(tmp_path / "c.pt")
    data = open(path, "rb").read()
    offset = {
        "header": 1,  # the first local header's signature
        "pickle": data.find(b"data.pkl") + 40,  # inside data.pkl's record
        "checksum": len(data) - 3,  # a hex digit of the checksum
        "magic": len(data) - 80,  # "torch-distribute:sha256:"
        "comment_length": len(data) - 89,  # the end-of-archive record's comment length
    }[where]
    _flip(path, offset)
    with pytest.raises(CorruptCheckpointError) as info:
        _read(path)
    assert str(path) in str(info.value) and "damaged" in str(info.value)


def test_empty_and_foreign_files(tmp_path):
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(CorruptCheckpointError, match="truncated: the file is empty"):
        _read(empty)
    text = tmp_path / "text.pt"
    text.write_text("not a checkpoint at all")
    with pytest.raises(td.CheckpointError, match="wrong format"):
        _read(text)
    other_zip = tmp_path / "other.zip"
    with zipfile.ZipFile(other_zip, "w") as archive:
        archive.writestr("hello.txt", "hi")
    with pytest.raises(td.CheckpointError, match="no data.pkl"):
        _read(other_zip)
    foreign = tmp_path / "foreign.pt"
    torch.save({"weight": torch.ones(2)}, foreign)
    with pytest.raises(td.CheckpointError, match="not a torch-distribute checkpoint"):
        _read(foreign)
    (tmp_path / "adir").mkdir()
    with pytest.raises(td.CheckpointError, match="is a directory"):
        _read(tmp_path / "adir")


def test_checkpoints_without_checksum_still_load_without_warnings(tmp_path):
    model, optimizer, marker = _objects()
    state = td.Checkpoint(model=model, optimizer=optimizer, marker=marker).state_dict()
    path = tmp_path / "ckpt-1"
    torch.save({"format": td.checkpoint.FORMAT, "version": 1, "save_counter": 1, "objects": state["objects"]}, path)
    assert file_io.read_checksum(str(path)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert td.latest_checkpoint(tmp_path) == str(path)
        fresh, fresh_optimizer, fresh_marker = _objects(seed=3)
        td.Checkpoint(model=fresh, optimizer=fresh_optimizer, marker=fresh_marker).restore(path).assert_consumed()
        assert CheckpointManager(td.Checkpoint(marker=fresh_marker), tmp_path).restore_or_initialize() == str(path)
    assert torch.equal(fresh[0].weight, model[0].weight) and torch.equal(fresh_marker, MARKER)


# -- the index ---------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["../elsewhere/ckpt-1", "/etc/passwd", "sub/../../x"])
def test_index_entries_outside_the_directory_are_refused(tmp_path, entry):
    directory = tmp_path / "ckpts"
    step = torch.zeros(())
    td.Checkpoint(step=step).save(directory / "ckpt")
    (tmp_path / "elsewhere").mkdir()
    td.Checkpoint(step=step).write(tmp_path / "elsewhere" / "ckpt-1")
    (directory / "checkpoint").write_text(json.dumps({"latest": entry, "all": ["ckpt-1", entry]}))
    with pytest.raises(td.CheckpointError, match="outside its directory"):
        td.latest_checkpoint(directory)
    with pytest.raises(td.CheckpointError, match="outside its directory"):
        CheckpointManager(td.Checkpoint(step=step), directory)
    (directory / "checkpoint").write_text(json.dumps({"latest": "ckpt-1", "all": [entry]}))
    with pytest.raises(td.CheckpointError, match="outside its directory"):
        td.latest_checkpoint(directory)


def test_an_absolute_index_entry_inside_the_directory_is_accepted(tmp_path):
    path = td.Checkpoint(step=torch.zeros(())).save(tmp_path / "ckpt")
    (tmp_path / "checkpoint").write_text(json.dumps({"latest": path, "all": [path]}))
    assert td.latest_checkpoint(tmp_path) == path


# -- falling back to the newest intact checkpoint ----------------------------------------------
def _three_saves(directory) -> tuple[torch.Tensor, CheckpointManager, list[str]]:
    step = torch.zeros(())
    manager = CheckpointManager(td.Checkpoint(step=step), directory, max_to_keep=5)
    paths = []
    for _ in range(3):
        step += 1
        paths.append(manager.save())
    return step, manager, paths


def test_latest_checkpoint_passes_over_a_truncated_newest_with_a_warning(tmp_path):
    step, manager, paths = _three_saves(tmp_path)
    data = open(paths[2], "rb").read()
    open(paths[2], "wb").write(data[: len(data) // 2])
    with pytest.warns(UserWarning, match="ckpt-3.*truncated"):
        assert td.latest_checkpoint(tmp_path) == paths[1]
    with pytest.warns(UserWarning, match="ckpt-3"):
        assert manager.latest_checkpoint == paths[1]
    fresh = torch.zeros(())
    with pytest.warns(UserWarning, match="ckpt-3"):
        assert CheckpointManager(td.Checkpoint(step=fresh), tmp_path).restore_or_initialize() == paths[1]
    assert fresh.item() == 2.0


def test_restore_or_initialize_falls_back_on_a_checksum_mismatch(tmp_path):
    step, manager, paths = _three_saves(tmp_path)
    _flip(paths[2], open(paths[2], "rb").read().find(b"data.pkl") + 40)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # cheap check: the damage inside is not seen here
        assert td.latest_checkpoint(tmp_path) == paths[2]
    fresh = torch.zeros(())
    checkpoint = td.Checkpoint(step=fresh)
    with pytest.raises(td.CheckpointError, match="checksum mismatch"):
        checkpoint.restore(paths[2])
    assert fresh.item() == 0.0  # nothing restored from a damaged file
    with pytest.warns(UserWarning, match="ckpt-3.*checksum mismatch"):
        assert CheckpointManager(checkpoint, tmp_path).restore_or_initialize() == paths[1]
    assert fresh.item() == 2.0 and checkpoint.save_counter == 2


def test_every_checkpoint_damaged_raises_rather_than_starting_fresh(tmp_path):
    step, manager, paths = _three_saves(tmp_path)
    for path in paths:
        open(path, "wb").write(open(path, "rb").read()[:100])
    with pytest.raises(CorruptCheckpointError, match="Every checkpoint"):
        td.latest_checkpoint(tmp_path)
    with pytest.raises(CorruptCheckpointError, match="Every checkpoint"):
        CheckpointManager(td.Checkpoint(step=torch.zeros(())), tmp_path).restore_or_initialize()


def test_a_scanned_file_that_is_no_checkpoint_is_skipped_quietly(tmp_path):
    path = td.Checkpoint(step=torch.zeros(())).write(tmp_path / "ckpt-1")
    (tmp_path / "notes-7").write_text("my notes")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert td.latest_checkpoint(tmp_path) == path


def test_sharded_checkpoint_checksums(tmp_path):
    model = nn.Linear(8, 8)
    payload = {"format": td.checkpoint.FORMAT, "version": 1, "save_counter": 1, "objects": {"model": model.state_dict()}}
    for n in (1, 2):
        write_sharded(str(tmp_path / f"ckpt-{n}"), payload, is_writer=True, barrier=lambda what: None)
    layout = torch.load(tmp_path / "ckpt-2" / "layout.pt", weights_only=True)
    assert sorted(layout[CHECKSUMS_KEY]) == [".metadata", "__0_0.distcp"]
    assert sorted(os.listdir(tmp_path / "ckpt-2")) == [".metadata", "__0_0.distcp", "layout.pt"]
    shard = tmp_path / "ckpt-2" / "__0_0.distcp"
    _flip(shard, shard.stat().st_size // 2)
    assert td.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-2")  # sizes are fine
    with pytest.raises(CorruptCheckpointError, match="__0_0.distcp.*checksum mismatch"):
        td.Checkpoint(model=nn.Linear(8, 8)).read(tmp_path / "ckpt-2")
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.warns(UserWarning, match="truncated"):
        assert td.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-1")
    fresh = nn.Linear(8, 8)
    with pytest.warns(UserWarning, match="ckpt-2"):
        assert CheckpointManager(td.Checkpoint(model=fresh), tmp_path).restore_or_initialize() == str(tmp_path / "ckpt-1")
    assert torch.equal(fresh.weight, model.weight)


def test_sharded_checkpoint_without_checksums_still_loads(tmp_path):
    model = nn.Linear(3, 3)
    path = tmp_path / "ckpt-1"
    write_sharded(str(path), {"format": td.checkpoint.FORMAT, "version": 1, "save_counter": 1,
                              "objects": {"model": model.state_dict()}}, is_writer=True, barrier=lambda what: None)
    layout = torch.load(path / "layout.pt", weights_only=True)
    del layout[CHECKSUMS_KEY]
    torch.save(layout, path / "layout.pt")  # as written before checksums existed
    fresh = nn.Linear(3, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert td.latest_checkpoint(tmp_path) == str(path)
        td.Checkpoint(model=fresh).read(path).assert_consumed()
    assert torch.equal(fresh.weight, model.weight)


# -- stale temporary files ----------------------------------------------------------------------
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _host_tag(tmp_path) -> str:
    name = os.path.basename(file_io.temporary_directory_name(str(tmp_path / "x")))
    return name.split(".td-", 1)[1].split("-", 1)[0]


def _make(path, age: float, directory: bool = False, content: str = "x") -> None:
    if directory:
        os.makedirs(path)
        for name in ("__0_0.distcp", ".metadata"):
            with open(os.path.join(path, name), "w") as f:
                f.write(content)
    else:
        with open(path, "w") as f:
            f.write(content)
    old = time.time() - age
    for p in ([os.path.join(path, n) for n in os.listdir(path)] if directory else []) + [path]:
        os.utime(p, (old, old))


@pytest.mark.parametrize("when", ["save", "manager"])
def test_stale_temporaries_of_our_naming_are_removed_and_nothing_else(tmp_path, when):
    host, dead, live = _host_tag(tmp_path), _dead_pid(), os.getpid()
    stale = [f".ckpt-1.td-{host}-{dead}-abc12345.tmp", f".checkpoint.td-{host}-{dead}-zz_9x0q1.tmp",
             f".ckpt-1.td-0badc0de-{live}-abc12345.tmp",  # another host: its pid cannot be checked
             f".ckpt-2.td-{host}-{dead}.partial", ".ckpt-3.partial"]
    kept = [f".ckpt-1.td-{host}-{live}-abc12345.tmp",  # a live process on this host
            "ckpt-1.tmp", ".notes.tmp", ".ckpt-1.abc12345.tmp", "notes.partial"]  # not our naming
    for name in stale + kept:
        _make(tmp_path / name, age=3600, directory=name.endswith(".partial"))
    _make(tmp_path / f".ckpt-9.td-{host}-{dead}-fresh000.tmp", age=-5)  # modified since we started
    kept.append(f".ckpt-9.td-{host}-{dead}-fresh000.tmp")
    os.makedirs(tmp_path / ".user.partial")
    (tmp_path / ".user.partial" / "my-file.txt").write_text("mine")
    kept.append(".user.partial")
    if when == "save":
        td.Checkpoint(step=torch.zeros(())).save(tmp_path / "ckpt")
    else:
        CheckpointManager(td.Checkpoint(step=torch.zeros(())), tmp_path)
    left = set(os.listdir(tmp_path))
    assert not left & set(stale)
    assert set(kept) <= left


def test_a_crashed_write_leaves_a_temporary_the_next_save_removes(tmp_path):
    """A process killed during a save leaves its temporary file; the next save removes it."""
    script = (
        "import os, sys, torch, torch_distribute as td\n"
        "real = torch.save\n"
        "def dying(obj, f, *a, **k):\n"
        "    f.write(b'PK\\x03\\x04 half')\n"
        "    f.flush()\n"
        "    os._exit(9)\n"
        "torch.save = dying\n"
        "td.Checkpoint(step=torch.zeros(())).save(sys.argv[1])\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ckpt")], timeout=120)
    assert done.returncode == 9
    left = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert len(left) == 1 and left[0].startswith(".ckpt-1.td-")
    old = time.time() - 24 * 3600  # written before this (long-running) test process started
    os.utime(tmp_path / left[0], (old, old))
    path = td.Checkpoint(step=torch.zeros(())).save(tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-1"] and path == str(tmp_path / "ckpt-1")


def test_single_process_saves_use_no_collective(tmp_path, monkeypatch):
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])

    def refuse(*args, **kwargs):
        raise AssertionError("a single-process save must not gather")

    monkeypatch.setattr(strategy.extended, "all_gather_objects", refuse)
    with strategy.scope():
        model = nn.Linear(2, 2)
    checkpoint = td.Checkpoint(model=model)
    manager = CheckpointManager(checkpoint, tmp_path / "m", max_to_keep=1)
    assert os.path.isfile(manager.save()) and os.path.isfile(checkpoint.save(tmp_path / "c"))
    assert manager.restore_or_initialize() == manager.latest_checkpoint


# -- a full disk or a file-size limit: the system's reason, not torch's "unexpected pos" ----------


@pytest.mark.timeout(60)
def test_a_full_disk_says_no_space_left_and_keeps_the_previous_checkpoint(tmp_path):
    disk = tmp_path / "tiny"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a 64 KiB tmpfs here: {mounted.stderr.strip()}")
    try:
        small = nn.Linear(4, 4)
        first = td.Checkpoint(model=small).save(str(disk / "ckpt"))
        big = td.Checkpoint(model=nn.Linear(200, 200), step=torch.tensor(1))  # 160 KB of weights
        with pytest.raises(td.CheckpointError) as info:
            big.save(str(disk / "ckpt"))
        message = str(info.value)
        assert "No space left on device (errno 28)" in message and str(disk / "ckpt-") in message, message
        assert f"bytes free in {disk}" in message and "unexpected pos" not in message, message
        restored = nn.Linear(4, 4)
        td.Checkpoint(model=restored).restore(first)
        torch.testing.assert_close(restored.weight, small.weight)
    finally:
        subprocess.run(["umount", str(disk)], check=False)


FILE_SIZE_LIMITED = """
import resource, signal, sys
import torch, torch_distribute as td
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (32 * 1024, 32 * 1024))
try:
    td.Checkpoint(model=torch.nn.Linear(200, 200)).save(sys.argv[1])
except td.CheckpointError as error:
    print("REPORTED", error)
"""


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="POSIX limits")
def test_a_file_size_limit_says_file_too_large(tmp_path):
    done = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMITED, str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=50)
    assert "REPORTED" in done.stdout, done.stdout + done.stderr
    assert "File too large (errno 27)" in done.stdout and str(tmp_path / "ckpt-1") in done.stdout, done.stdout
    assert not list(tmp_path.glob("ckpt-1*")), "the partial file was left behind"
