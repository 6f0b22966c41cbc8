"""``import torch_distribute`` leaves torch, the process and the interpreter as they were; the
first strategy installs the patches of ``strategies/torch_patches.py`` and the last one's
collection undoes them; every torch object that table relies on still has the call shape it
records, so a torch upgrade that changes one fails here."""

from __future__ import annotations

import importlib
import json
import logging
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest
import torch

from torch_distribute.strategies import torch_patches

pytestmark = pytest.mark.timeout(300)

# Run in a fresh interpreter: snapshot, import every module of the package, compare; make a
# strategy and use it, drop it, compare again. Prints a JSON report.
PROBE = r'''
import ast, atexit, gc, importlib, importlib.util, json, logging, os, pathlib, pkgutil, signal, sys, threading, warnings
import weakref
import torch
import torch.nn.modules.module, torch.optim.optimizer, torch.optim.lr_scheduler, torch.amp
import torch.nn.utils.clip_grad


def umask():
    with open("/proc/self/status") as status:
        return next((line.split()[1] for line in status if line.startswith("Umask:")), None)


def torch_loggers():
    found = {}
    for name, logger in [("", logging.getLogger())] + sorted(logging.root.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and (name == "" or name == "torch" or name.startswith("torch.")):
            found[name] = (tuple(logger.handlers), tuple(logger.filters), logger.level, logger.propagate,
                           logger.disabled)
    return found


def closure_cells(function):
    return tuple(cell.cell_contents for cell in function.__closure__ or ())


def snapshot():
    modules = {name: module for name, module in sys.modules.items()
               if module is not None and (name == "torch" or name.startswith("torch."))}
    attributes = {name: dict(vars(module)) for name, module in modules.items()}
    classes = {}
    containers = {}
    for name, namespace in attributes.items():
        for attribute, value in namespace.items():
            if isinstance(value, type) and getattr(value, "__module__", "") == name:
                classes[f"{name}.{attribute}"] = (value, dict(vars(value)))
            elif isinstance(value, (dict, list, set)) and attribute.startswith("_global"):
                containers[f"{name}.{attribute}"] = len(value)  # torch's global hook registries
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    return {
        "modules": attributes, "classes": classes, "containers": containers,
        "clip cells": {name: closure_cells(getattr(torch.nn.utils.clip_grad, name))
                       for name in ("clip_grad_norm_", "clip_grad_value_")},
        "loggers": torch_loggers(),
        "meta_path": list(sys.meta_path), "path_hooks": list(sys.path_hooks),
        "environ": dict(os.environ), "atexit": atexit._ncallbacks(), "umask": umask(),
        "hooks": (sys.excepthook, threading.excepthook, sys.displayhook, sys.gettrace(), sys.getprofile(),
                  sys.getrecursionlimit(), sys.unraisablehook, tuple(gc.callbacks), gc.get_threshold()),
        "signals": handlers, "warnings": list(warnings.filters),
        "torch settings": (torch.get_num_threads(), torch.get_default_dtype(), torch.is_grad_enabled(),
                           torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision(),
                           torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic),
        "dynamo": "torch._dynamo" in sys.modules,
        "dynamo config": {name: sys.modules[name].get_config_copy() for name in ("torch._dynamo.config",
                          "torch._inductor.config") if name in sys.modules},
    }


COUNTERS = {"torch.utils.hooks.RemovableHandle.next_id"}  # counts every hook registered, anywhere


def differences(before, after, allowed=()):
    found = []
    for name, namespace in before["modules"].items():
        now = after["modules"][name]
        for attribute, value in namespace.items():
            if attribute not in now:
                found.append(f"{name}.{attribute} removed")
            elif now[attribute] is not value:
                found.append(f"{name}.{attribute} replaced by {now[attribute]!r}")
        for attribute, value in now.items():
            if attribute not in namespace and not isinstance(value, type(sys)):
                found.append(f"{name}.{attribute} added")
    for name, (cls, namespace) in before["classes"].items():
        now = dict(vars(cls))
        for attribute in set(namespace) | set(now):
            if namespace.get(attribute) is not now.get(attribute) and f"{name}.{attribute}" not in COUNTERS:
                found.append(f"{name}.{attribute} changed")
    for key in ("containers", "clip cells", "loggers"):
        for name in set(before[key]) | set(after[key]):
            was, now = before[key].get(name), after[key].get(name)
            if key == "loggers" and was is None and now is not None:
                was = ((), (), logging.NOTSET, True, False)  # a torch logger made since: as getLogger makes it
            if was != now:
                found.append(f"{key}: {name}: {was!r} -> {now!r}")
    for key in ("meta_path", "path_hooks", "environ", "atexit", "umask", "hooks", "signals", "warnings",
                "torch settings", "dynamo", "dynamo config"):
        if before[key] != after[key] and key not in allowed:
            found.append(f"{key}: {before[key]!r} -> {after[key]!r}")
    return found


def torch_modules_the_package_imports():
    """Every torch module named in an import statement of the package (read, not imported):
    imported before the first snapshot, so that what torch does when they load is not counted."""
    root = pathlib.Path(importlib.util.find_spec("torch_distribute").submodule_search_locations[0])
    names = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return sorted(n for n in names if n.split(".")[0] == "torch" and not n.startswith(("torch._dynamo", "torch._inductor")))


for name in torch_modules_the_package_imports():
    try:
        importlib.import_module(name)
    except ImportError:
        pass  # a name imported from a module, not a module

report = {}
before = snapshot()
import torch_distribute
for info in pkgutil.walk_packages(torch_distribute.__path__, "torch_distribute."):
    importlib.import_module(info.name)
report["import"] = differences(before, snapshot())
from torch_distribute.strategies import torch_patches
report["installed at import"] = torch_patches.strategy_patches_installed()


def train_one_step(layer, optimizer, scaler, run=lambda step, x: step(x)):
    def step(x):
        loss = torch_distribute.compute_average_loss(layer(x).sum(1), global_batch_size=4)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(layer.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    run(step, torch.ones(4, 2))


# What torch sets up on its own the first time (it imports dynamo for the first optimizer):
# done once without a strategy, before the baseline.
layer = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
train_one_step(layer, optimizer, torch.amp.GradScaler("cpu"))
baseline = snapshot()
report["weakref.finalize's own atexit handler"] = weakref.finalize._registered_with_atexit

strategy = torch_distribute.MirroredStrategy(["cpu:0", "cpu:1"])
report["installed by a strategy"] = torch_patches.strategy_patches_installed()
with strategy.scope():
    layer = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
train_one_step(layer, optimizer, torch.amp.GradScaler("cpu"), lambda step, x: strategy.run(step, args=(x,)))
scheduler.step()
report["patched while it lives"] = differences(baseline, snapshot(), allowed=("atexit",))
del strategy, layer, optimizer, scheduler
for _ in range(3):  # an optimizer's entry in owner_of's weak map lets go of its strategy a round later
    gc.collect()
report["installed after it is gone"] = torch_patches.strategy_patches_installed()
after = snapshot()
# What stays by design (torch_patches.PROCESS_SETTINGS): the replica threads' atexit handler.
report["after it is gone"] = differences(baseline, after, allowed=("atexit",))
report["atexit added"] = after["atexit"] - baseline["atexit"]
print(json.dumps(report))
'''


def test_import_changes_nothing_and_the_last_strategy_undoes_its_patches() -> None:
    root = str(pathlib.Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    env.pop("TD_LOG_LEVEL", None)
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=240, env=env,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["import"] == []
    assert report["installed at import"] is False
    assert report["installed by a strategy"] is True
    # Exactly the table's PATCHES and TORCH_HOOKS_USED, each once.
    expected = ["torch.optim.optimizer.Optimizer.__init__ ", "torch.optim.lr_scheduler.LRScheduler.__init__ ",
                *(f"torch.amp.grad_scaler.GradScaler.{name} " for name in ("unscale_", "step", "update")),
                "torch.autograd.backward ", "clip cells: clip_grad_norm_:", "clip cells: clip_grad_value_:",
                *(f"containers: torch.nn.modules.module._global_{kind}_registration_hooks: 0 -> 1"
                  for kind in ("parameter", "buffer", "module")),
                "containers: torch.optim.optimizer._global_optimizer_pre_hooks: 0 -> 1"]
    patched = report["patched while it lives"]
    assert sorted(next((e for e in expected if line.startswith(e)), line) for line in patched) == sorted(expected)
    assert report["installed after it is gone"] is False
    assert report["after it is gone"] == []
    # replica_threads._close_all, and weakref's own handler where a finalizer is the first
    assert report["atexit added"] == 1 + (not report["weakref.finalize's own atexit handler"])


def _resolve(dotted: str) -> Any:
    """The object a dotted name names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            found = getattr(found, part)
        return found
    raise ImportError(dotted)


TABLE = torch_patches.PATCHES + torch_patches.PROCESS_SETTINGS + torch_patches.TORCH_HOOKS_USED


@pytest.mark.parametrize("change", [c for c in TABLE if c.torch_target], ids=lambda c: c.torch_target)
def test_every_torch_target_still_exists_with_the_recorded_call_shape(change: torch_patches.Change) -> None:
    found = _resolve(change.torch_target)
    if change.signature is not None:
        assert torch_patches.call_shape(found) == change.signature, (
            f"{change.torch_target} changed in torch {torch.__version__} (checked on "
            f"{torch_patches.TORCH_VERSIONS_CHECKED}): review {change.code} and the table")


def test_the_targets_that_are_not_functions_are_what_the_table_says() -> None:
    assert isinstance(_resolve("torch._dynamo.config.recompile_limit"), int)
    logger = _resolve("torch._inductor.cudagraph_utils.cudagraphs_log")
    assert isinstance(logger, logging.Logger) and logger.name == "torch._inductor.cudagraph_utils.__cudagraphs"
    assert callable(_resolve("torch.set_num_threads"))
    spec = importlib.util.find_spec("torch._dynamo")
    assert spec is not None and callable(getattr(spec.loader, "exec_module", None))


@pytest.mark.parametrize("name", ["clip_grad_norm_", "clip_grad_value_"])
def test_torch_clipping_is_a_no_grad_wrapper_around_one_cell(name: str) -> None:
    """The layout the clipping patch relies on (else it falls back to replacing attributes,
    which misses a name imported before the strategy)."""
    from torch.nn.utils import clip_grad

    public = getattr(clip_grad, name)
    cells = [c for c in public.__closure__ or () if getattr(c.cell_contents, "__name__", None) == name]
    assert len(cells) == 1 and callable(cells[0].cell_contents)
    assert getattr(torch.nn.utils, name) is public


def test_every_entry_is_complete() -> None:
    for change in TABLE:
        assert all((change.target, change.change, change.why, change.installed, change.undone, change.code))
        _resolve(change.code)
    assert torch_patches.TORCH_VERSIONS_CHECKED


def test_td_function_changes_torch_logging_and_dynamo_only_while_one_that_compiled_lives() -> None:
    import gc

    import torch_distribute as td
    from torch_distribute import compiled_function

    cudagraph_log = logging.getLogger("torch._inductor.cudagraph_utils.__cudagraphs")
    ours = compiled_function._cudagraph_skips
    for _ in range(3):  # an earlier test's td.function kept only by a reference cycle goes now
        gc.collect()
    others = ours in cudagraph_log.handlers  # another td.function that compiled lives (then all stays)
    add_one = td.function(lambda x: x + 1)
    add_one(torch.ones(2))  # the first call learns that it calls no strategy.run
    assert torch.equal(add_one(torch.ones(2)), torch.full((2,), 2.0))  # compiled
    assert cudagraph_log.handlers.count(ours) == 1
    config = torch._dynamo.config
    limit = config.recompile_limit
    compiled_function._settings.allow_graphs_for(limit)  # what strategy.run asks for that many replicas
    assert config.recompile_limit > limit
    del add_one
    for _ in range(3):
        gc.collect()
    assert (ours in cudagraph_log.handlers) is others
    assert (config.recompile_limit == limit) is not others
