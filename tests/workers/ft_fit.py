"""A fault-tolerant ``fit`` for tests/test_fault_tolerant.py (``launch --nproc 3 --min-workers 2``).

``td.keras.Model`` of ``ft_model`` compiled with Adam and sparse categorical cross-entropy
on logits, ``fit`` on the ``DataLoader`` of ``ft_common`` (its global batches, one pass per
epoch) with ``--validate``: validation data each epoch. Prints ``FTSTART``/``FTSTEP``/
``FTRESULT`` lines as ``ft_mwms.py`` does (``FTSTEP`` from a callback after every batch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch_distribute as td  # noqa: E402
from workers.ft_common import LR, SEED, digest, make_loader, make_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args()
    slot = int(os.environ["RANK"])
    generation = int(os.environ.get("TD_RESTART_COUNT", "0"))
    print(f"FTSTART {slot} {os.getpid()} {generation}", flush=True)
    torch.manual_seed(SEED)
    ft = td.experimental.FaultTolerance(timeout=args.timeout, quorum_timeout=120)
    strategy = td.MultiWorkerMirroredStrategy(fault_tolerance=ft)
    with strategy.scope():
        model = td.keras.Model(make_model())
        model.compile(optimizer=torch.optim.Adam(model.parameters(), lr=LR),
                      loss=td.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])

    def after_batch(batch: int, logs: dict) -> None:
        live = strategy.num_replicas_in_sync
        print(f"FTSTEP {slot} {os.getpid()} {ft.committed_step} {live} 0", flush=True)
        time.sleep(0.02 if live == 3 else 0.25)

    history = model.fit(make_loader(), epochs=args.epochs, verbose=0, validation_data=make_loader(),
                        callbacks=[td.keras.callbacks.LambdaCallback(on_train_batch_end=after_batch)])
    params = list(model.parameters())
    result = {"slot": slot, "pid": os.getpid(), "generation": generation, "committed": ft.committed_step,
              "params": digest(params), "optimizer": digest(model.optimizer.state_dict()),
              "values": [p.detach().reshape(-1).tolist() for p in params],
              "val_loss": history.history["val_loss"][-1]}
    print("FTRESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
