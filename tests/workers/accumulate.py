"""Worker: gradient accumulation (two backward passes per step) under MultiWorkerMirroredStrategy.

Prints the final parameters as JSON. ``--set-to-none`` picks how gradients are cleared.
"""

import argparse
import json

import torch
from accumulate_reference import batches, build, micro_loss

import torch_distribute as td

parser = argparse.ArgumentParser()
parser.add_argument("--zero-grad", choices=["none", "zeros"], required=True)
args = parser.parse_args()
torch.set_num_threads(1)

strategy = td.MultiWorkerMirroredStrategy(communication_options=td.CommunicationOptions(timeout_seconds=30))
with strategy.scope():
    model, optimizer = build()


def accumulate(x, y, global_batch_size):
    micro_loss(model, x, y, global_batch_size=global_batch_size).backward()


for step_batches in batches():
    total = sum(b[0].shape[0] for b in step_batches)
    for batch in step_batches:
        for x, y in strategy.experimental_distribute_dataset([batch]):
            strategy.run(accumulate, args=(x, y, total))

    def apply():
        optimizer.step()
        optimizer.zero_grad(set_to_none=args.zero_grad == "none")

    strategy.run(apply)
print(json.dumps({"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()}))
