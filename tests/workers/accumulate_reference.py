"""Model, data and loss shared by the accumulation worker and its plain-PyTorch reference."""

import torch
import torch.nn.functional as F

import torch_distribute as td


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def batches():
    """Four steps of two micro-batches (global sizes 6 and 5)."""
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in (6, 5)]
            for _ in range(4)]


def micro_loss(model, x, y, global_batch_size):
    return td.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"),
                                   global_batch_size=global_batch_size)


def reference_params():
    model, optimizer = build()
    for step_batches in batches():
        total = sum(b[0].shape[0] for b in step_batches)
        for x, y in step_batches:
            (F.cross_entropy(model(x), y, reduction="sum") / total).backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
