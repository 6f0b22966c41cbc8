"""The table ``Model.summary`` prints: each top-level layer with its parameter count, and the totals.

>>> import torch
>>> print("\\n".join(summary_lines("net", torch.nn.Sequential(torch.nn.Linear(2, 3)))))
Model: "net"
------------------------------------
Layer (type)               Param #
====================================
0 (Linear)                       9
====================================
Total params: 9
Trainable params: 9
Non-trainable params: 0
"""

from __future__ import annotations

from torch import nn

__all__ = ["summary_lines"]


def summary_lines(name: str, module: nn.Module) -> list[str]:
    """The summary of the model called ``name`` whose layers are ``module``'s children (or
    ``module`` itself when it has none), one line each."""
    rows = [(child_name or "(model)", type(child).__name__, sum(p.numel() for p in child.parameters()))
            for child_name, child in (module.named_children() if list(module.children()) else [("", module)])]
    total = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    width = max([len(f"{n} ({t})") for n, t, _ in rows] + [20])
    lines = [f'Model: "{name}"', "-" * (width + 16), f"{'Layer (type)':<{width}}  {'Param #':>12}",
             "=" * (width + 16)]
    lines += [f"{f'{n} ({t})':<{width}}  {c:>12,}" for n, t, c in rows]
    lines += ["=" * (width + 16), f"Total params: {total:,}", f"Trainable params: {trainable:,}",
              f"Non-trainable params: {total - trainable:,}"]
    return lines
