"""Worker: GradScaler under MultiWorkerMirroredStrategy, an inf in worker 1's rows at one step
(``--no-scaler``: plain float32 steps that clip, without the inf).

Prints the final parameters, the scale after every step and whether the parameters stayed
bitwise unchanged through the step with the inf, as JSON.
"""

import argparse
import json

import torch
from amp_reference import GLOBAL_BATCH, INJECT_STEP, build, flat, make_data, make_scaler, step

import torch_distribute as td

parser = argparse.ArgumentParser()
parser.add_argument("--local-replicas", type=int, default=1)
parser.add_argument("--clip", type=float, default=None)
parser.add_argument("--no-scaler", action="store_true")
args = parser.parse_args()
torch.set_num_threads(1)

devices = [f"cpu:{k}" for k in range(args.local_replicas)]
strategy = td.MultiWorkerMirroredStrategy(
    communication_options=td.CommunicationOptions(timeout_seconds=30), devices=devices)
with strategy.scope():
    model, optimizer = build()
scaler = None if args.no_scaler else make_scaler()

# DATA sharding gives worker 1 the second half of every global batch: the inf is in its rows.
data = make_data(inject_row=None if args.no_scaler else GLOBAL_BATCH - 1)
scales, unchanged = [], None
for index, batch in enumerate(strategy.experimental_distribute_dataset(data)):
    before = flat(model).clone()
    strategy.run(step, args=(model, optimizer, scaler, batch, args.clip))
    scales.append(scaler.get_scale() if scaler is not None else None)
    if index == INJECT_STEP:
        unchanged = bool(torch.equal(before, flat(model)))
print(json.dumps({"params": flat(model).tolist(), "scales": scales, "unchanged": unchanged}))
