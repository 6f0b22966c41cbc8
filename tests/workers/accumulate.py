"""Worker: gradient accumulation (two backward passes per step) under MultiWorkerMirroredStrategy.

Prints the final parameters as JSON. ``--set-to-none`` picks how gradients are cleared.
"""

import argparse
import json

import torch

import torch_distribute as td
from accumulate_reference import batches, build, micro_loss

parser = argparse.ArgumentParser()
parser.add_argument("--zero-grad", choices=["none", "zeros"], required=True)
args = parser.parse_args()
torch.set_num_threads(1)

strategy = td.MultiWorkerMirroredStrategy(communication_options=td.CommunicationOptions(timeout_seconds=30))
with strategy.scope():
    model, optimizer = build()
for step_batches in batches():
    micro = [strategy.experimental_distribute_dataset([b]) for b in step_batches]

    def accumulate(x, y):
        micro_loss(model, x, y, global_batch_size=sum(b[0].shape[0] for b in step_batches)).backward()

    for dataset in micro:
        for x, y in dataset:
            strategy.run(accumulate, args=(x, y))

    def apply():
        optimizer.step()
        optimizer.zero_grad(set_to_none=args.zero_grad == "none")

    strategy.run(apply)
print(json.dumps({"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()}))
