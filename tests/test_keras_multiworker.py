"""td.keras fit under MultiWorkerMirroredStrategy: 2 worker processes give one process's numbers,
and so does the whole model ``ModelCheckpoint`` wrote, loaded in the scope and trained on.

This file is also the worker script: ``python -m torch_distribute.launch --nproc 2
tests/test_keras_multiworker.py --out DIR`` runs ``worker()`` in each process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_distribute as td

REPO = Path(__file__).resolve().parents[1]
RESULT = "KERASMW "


def _data():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(45, 4, generator=g)  # 5 global batches of 8, one of 5 rows (2 workers x 2 replicas)
    return x, torch.randint(0, 3, (45,), generator=g)


def _fit(strategy, seed: int, out_dir: str | None, scratch: str | None = None) -> dict:
    torch.manual_seed(seed)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model = td.keras.Model(torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)))
    model.compile(td.keras.optimizers.Adam(learning_rate=0.02),
                  td.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    x, y = _data()
    callbacks = []
    if out_dir is not None:
        callbacks = [td.keras.callbacks.CSVLogger(os.path.join(out_dir, "log.csv")),
                     td.keras.callbacks.ModelCheckpoint(os.path.join(out_dir, "ckpt-{epoch}.pt"))]
    history = model.fit(x, y, batch_size=8, epochs=3, validation_data=(x[:19], y[:19]), callbacks=callbacks,
                        verbose="auto" if out_dir else 0)
    # The whole model ModelCheckpoint wrote, loaded in the scope (a plain model in one process), trains on.
    path = os.path.join(out_dir, "ckpt-3.pt") if out_dir else model.save(os.path.join(scratch, "whole.pt"))
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        restored = td.keras.models.load_model(path)
    restored.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist(),
            "restored": torch.cat([p.detach().reshape(-1) for p in restored.parameters()]).tolist(),
            "history": history.history,
            "evaluate": model.evaluate(x, y, batch_size=7, verbose=0),
            "predict": model.predict(x[:11], batch_size=4, verbose=0).tolist()}


def worker() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    strategy = td.MultiWorkerMirroredStrategy(
        devices=["cpu:0", "cpu:1"], communication_options=td.CommunicationOptions(timeout_seconds=30))
    rank = strategy.extended.worker_index
    result = _fit(strategy, seed=100 + rank, out_dir=args.out)  # every worker seeds differently
    print(RESULT + json.dumps({"rank": rank, **result}), flush=True)


@pytest.mark.timeout(150)
@pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")
def test_fit_on_two_workers_by_two_replicas_equals_one_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log = tmp_path / "launch.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "torch_distribute.launch", "--nproc", "2", "--timeout", "110",
             "--grace-period", "2", __file__, "--out", str(tmp_path)],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=130)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    text = log.read_text()
    assert code == 0, text[-4000:]
    results = {}
    for line in text.splitlines():
        payload = line.split("] ", 1)[1] if line.startswith("[rank ") else line
        if payload.startswith(RESULT):
            data = json.loads(payload[len(RESULT):])
            results[data["rank"]] = data
    assert sorted(results) == [0, 1], text[-4000:]
    reference = _fit(None, seed=100, out_dir=None, scratch=str(tmp_path))  # the chief's seed: its initial values win
    for rank in (0, 1):
        got = results[rank]
        torch.testing.assert_close(torch.tensor(got["params"]), torch.tensor(reference["params"]), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(got["restored"]), torch.tensor(reference["restored"]), rtol=1e-5, atol=1e-5)
        for key, values in reference["history"].items():
            torch.testing.assert_close(torch.tensor(got["history"][key]), torch.tensor(values), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(got["evaluate"]), torch.tensor(reference["evaluate"]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(got["predict"]), torch.tensor(reference["predict"]), rtol=1e-5, atol=1e-5)
    # Only the chief prints the progress bar and writes files.
    assert "[rank 0] Epoch 1/3" in text and "[rank 1] Epoch" not in text
    assert sorted(p.name for p in tmp_path.iterdir() if p.name not in ("launch.log", "whole.pt")) == [
        "ckpt-1.pt", "ckpt-2.pt", "ckpt-3.pt", "log.csv"]
    assert len((tmp_path / "log.csv").read_text().splitlines()) == 4


if __name__ == "__main__":
    worker()
