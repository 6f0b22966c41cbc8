"""Worker: compiled training under MultiWorkerMirroredStrategy; prints a ``CMWRESULT {json}`` line per case.

    python -m torch_distribute.launch --nproc 2 tests/workers/compiled_mwms.py --replicas R --case C [--case C ...]

Cases (``CASES``): ``function_*`` decorate the distributed step (the function calling
``strategy.run``) with ``td.function``; ``module_*`` call ``torch.compile(model)`` (made in
the scope) inside a plain replica step. Each case trains a fresh model for ``EPOCHS`` epochs
on 37 examples in global batches of 8 (the last one ragged, 5 rows) and reports the
parameters, every local copy, the losses and the graphs compiled after each epoch, in a
line printed as soon as the case ends. An exception in a case is recorded instead of ending
the job, so the other cases still report; a broken collective ends it within ``--timeout``,
and a case still running after ``--case-timeout`` (a hang) dumps every thread's stack to
stderr and exits 1.

The model, the data and the one-process eager reference (``train_reference``) live here so
that the test process builds exactly the same things; nothing at import time needs
``torch.distributed``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import time
import traceback

import torch
import torch.nn.functional as F

RESULT_PREFIX = "CMWRESULT "
N_SAMPLES = 37  # 4 global batches of 8 and a ragged one of 5
GLOBAL_BATCH = 8
EPOCHS = 2
CHIEF_SEED = 1
CASES = {  # name: (what is compiled, optimizer)
    "function_sgd": ("function", "sgd"),
    "function_adam": ("function", "adam"),
    "module_adam": ("module", "adam"),
}


def worker_seed(rank: int) -> int:
    """Every worker seeds differently: the chief's initial values must win anyway."""
    return 100 * rank + CHIEF_SEED


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def make_loader() -> torch.utils.data.DataLoader:
    """Global batches, reshuffled every epoch, in the same order in every process."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(N_SAMPLES, 6, generator=generator)
    y = torch.randint(0, 3, (N_SAMPLES,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=GLOBAL_BATCH,
                                       shuffle=True, generator=torch.Generator().manual_seed(3))


def global_batch_sizes() -> list[int]:
    return [min(GLOBAL_BATCH, N_SAMPLES - start) for start in range(0, N_SAMPLES, GLOBAL_BATCH)]


def flat(model: torch.nn.Module) -> list[float]:
    """Every parameter as Python floats (float32 values round-trip exactly through JSON)."""
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()]).tolist()


def train_reference(optimizer_name: str) -> dict:
    """One process, no strategy, eager: the chief's seed, the same global batches and loss."""
    torch.manual_seed(CHIEF_SEED)
    model = make_model()
    init = flat(model)
    optimizer = make_optimizer(optimizer_name, model.parameters())
    loader = make_loader()  # one loader: its shuffle order moves on every epoch
    losses = []
    for _ in range(EPOCHS):
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb), yb, reduction="sum") / xb.shape[0]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return {"init": init, "params": flat(model), "losses": losses}


def _train(td, strategy, case: str) -> dict:
    from torch._dynamo.utils import counters

    compile_where, optimizer_name = CASES[case]
    torch._dynamo.reset()
    counters.clear()
    rank = strategy.extended.worker_index
    torch.manual_seed(worker_seed(rank))
    with strategy.scope():
        model = make_model()
        optimizer = make_optimizer(optimizer_name, model.parameters())
        forward = torch.compile(model) if compile_where == "module" else model
    init = flat(model)

    def replica_step(batch, global_batch_size):
        xb, yb = batch
        per_example = F.cross_entropy(forward(xb), yb, reduction="none")
        loss = td.compute_average_loss(per_example, global_batch_size=global_batch_size)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def distributed_step(batch, global_batch_size):
        per_replica = strategy.run(replica_step, args=(batch, global_batch_size))
        return strategy.reduce(td.ReduceOp.SUM, per_replica, axis=None)

    if compile_where == "function":
        distributed_step = td.function(distributed_step)

        def graphs() -> int:
            return distributed_step.experimental_get_tracing_count()
    else:
        def graphs() -> int:
            return int(counters["stats"]["unique_graphs"])

    dist_ds = strategy.experimental_distribute_dataset(make_loader())
    sizes = global_batch_sizes()
    losses, graphs_after_epoch, steps_per_epoch, local_shapes = [], [], [], []
    for _ in range(EPOCHS):
        steps = 0
        for batch in dist_ds:
            local_shapes.append([int(t.shape[0]) for t in strategy.experimental_local_results(batch[0])])
            losses.append(float(distributed_step(batch, sizes[steps])))
            steps += 1
        steps_per_epoch.append(steps)
        graphs_after_epoch.append(graphs())
    copies = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]).tolist()
              for m in strategy.experimental_local_results(model)]
    return {"init": init, "params": flat(model), "copies": copies, "losses": losses,
            "graphs_after_epoch": graphs_after_epoch, "steps_per_epoch": steps_per_epoch,
            "local_shapes": local_shapes}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--case", action="append", choices=sorted(CASES), required=True)
    parser.add_argument("--timeout", type=float, default=60, help="collective deadline (s)")
    parser.add_argument("--case-timeout", type=float, default=60,
                        help="a case running longer dumps every thread's stack and exits 1")
    args = parser.parse_args()
    torch.set_num_threads(1)

    import torch_distribute as td

    strategy = td.MultiWorkerMirroredStrategy(
        devices=[f"cpu:{i}" for i in range(args.replicas)],
        communication_options=td.CommunicationOptions(timeout_seconds=args.timeout))
    rank = strategy.extended.worker_index
    for case in args.case:  # one result line per case, printed as soon as it is done
        result: dict = {"rank": rank, "case": case, "num_replicas_in_sync": strategy.num_replicas_in_sync}
        started = time.monotonic()
        faulthandler.dump_traceback_later(args.case_timeout, exit=True)  # a hang: stacks, exit 1
        try:
            result["result"] = _train(td, strategy, case)
        except Exception as error:  # noqa: BLE001 - reported to the test
            result["error"] = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
            if isinstance(error, td.WorkerUnavailableError):
                print(RESULT_PREFIX + json.dumps(result), flush=True)
                os._exit(1)
        finally:
            faulthandler.cancel_dump_traceback_later()
        result["seconds"] = time.monotonic() - started
        print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
