"""One worker of ``tests/test_compile_once.py``'s job: MultiWorkerMirroredStrategy (Gloo, one
CPU replica), a linear model and SGD made in its scope, two ``@td.function`` steps on a cold
inductor cache shared by the job's workers; prints a result line with what inductor's caches
did and the parameters."""

from __future__ import annotations

import json
import os
import sys

import torch

import torch_distribute as td

RESULT_PREFIX = "COMPILEONCE "
GLOBAL_BATCH = 8


def main() -> None:
    from torch._dynamo.utils import counters

    strategy = td.MultiWorkerMirroredStrategy(
        communication_options=td.CommunicationOptions(timeout_seconds=float(sys.argv[1])))
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = td.compute_average_loss((model(x).squeeze(1) - y) ** 2, global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    @td.function
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return strategy.reduce("sum", strategy.run(train_step, args=(x, y)), axis=None)

    generator = torch.Generator().manual_seed(1)
    data = [(torch.rand(GLOBAL_BATCH, 4, generator=generator), torch.rand(GLOBAL_BATCH, generator=generator))
            for _ in range(2)]
    losses = [float(step(x, y)) for x, y in strategy.experimental_distribute_dataset(data)]
    print(RESULT_PREFIX + json.dumps({
        "rank": int(os.environ["RANK"]),
        "losses": losses,
        "graphs": step.experimental_get_tracing_count(),
        "fx_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
        "fx_misses": int(counters["inductor"]["fxgraph_cache_miss"]),
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
    }), flush=True)


if __name__ == "__main__":
    main()
