"""Shared by ``tests/test_multi_worker.py`` and its worker scripts in ``tests/multiworker/``.

The model, the data and the single-process reference training live here so that the worker
processes and the test process build exactly the same things. No pytest, no
``torch.distributed`` here: worker scripts import this module too.
"""

from __future__ import annotations

import json
import time

import proc_helpers
import torch
import torch.nn.functional as F

RESULT_PREFIX = "MWRESULT "
N_SAMPLES = 49  # 6 global batches of 8 and a last one of 1 row (fewer rows than replicas)
GLOBAL_BATCH = 8
LR = 0.02
CHIEF_SEED = 1


def worker_seed(rank: int) -> int:
    """Every worker seeds differently: the chief's initial values must win anyway."""
    return 100 * rank + CHIEF_SEED


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def make_data(n: int = N_SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(n, 4, generator=generator)
    y = torch.randint(0, 3, (n,), generator=generator)
    return x, y


def make_loader(x: torch.Tensor, y: torch.Tensor, batch: int = GLOBAL_BATCH) -> torch.utils.data.DataLoader:
    """Global batches, reshuffled every epoch, in the same order in every process."""
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=batch, shuffle=True,
        generator=torch.Generator().manual_seed(3))


def global_batch_sizes(n: int = N_SAMPLES, batch: int = GLOBAL_BATCH) -> list[int]:
    return [min(batch, n - start) for start in range(0, n, batch)]


def flat(model: torch.nn.Module) -> list[float]:
    """Every parameter as Python floats (float32 values round-trip exactly through JSON)."""
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()]).tolist()


def train_reference(epochs: int, n: int = N_SAMPLES, batch: int = GLOBAL_BATCH, lr: float = LR,
                    init_device: str = "cpu") -> dict:
    """One process, no strategy: the same model (chief's seed), data, global batch and loss.

    ``init_device``: where the model is created (and so which generator draws its initial
    values); a strategy creates modules made in its scope on its first device.
    """
    torch.manual_seed(CHIEF_SEED)
    with torch.device(init_device):
        model = make_model()
    model = model.cpu()
    init = flat(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    x, y = make_data(n)
    loader = make_loader(x, y, batch)  # one loader: its shuffle order moves on every epoch
    losses, total, count = [], 0.0, 0
    for _ in range(epochs):
        for xb, yb in loader:
            per_example = F.cross_entropy(model(xb), yb, reduction="none")
            loss = per_example.sum() / xb.shape[0]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            total += float(per_example.detach().double().sum())
            count += xb.shape[0]
    return {"init": init, "params": flat(model), "losses": losses, "metric": total / count,
            "model": model, "optimizer": optimizer}


def emit(payload: dict) -> None:
    print(RESULT_PREFIX + json.dumps(payload), flush=True)


def parse_results(text: str) -> dict[int, dict]:
    """``{rank: payload}`` from worker output (plain, or prefixed ``[rank i] `` by the launcher)."""
    return proc_helpers.parse_results(text, RESULT_PREFIX)


def results_of_clean_exits(procs: proc_helpers.Processes, workers: list, seconds: float) -> dict[int, dict]:
    """``{rank: payload}`` of ``workers`` (rank order), each of which must exit 0 within
    ``seconds`` of now (an assertion error shows the tail of its output otherwise)."""
    deadline = time.monotonic() + seconds
    reports = {}
    for rank, proc in enumerate(workers):
        code = procs.wait(proc, deadline - time.monotonic())
        text = procs.output(proc)
        assert code == 0, text[-3000:]
        reports[rank] = parse_results(text)[rank]
    return reports
