"""``td.keras.models.load_model``: a model saved with ``Model.save``, rebuilt under any strategy.

Inside ``strategy.scope()`` the model is built there, so its parameters are mirrored (or
sharded) by that strategy and it trains at once with the restored optimizer state; outside
every scope it is a plain model. What the file holds: ``torch_distribute.keras.saving``.

>>> import torch_distribute as td
>>> with td.MirroredStrategy(["cpu:0", "cpu:1"]).scope():  # doctest: +SKIP
...     model = td.keras.models.load_model("regressor.pt")
>>> history = model.fit(x, y, epochs=1)  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from torch_distribute import context
from torch_distribute.checkpoint import Checkpoint
from torch_distribute.errors import CheckpointError, ContextError, InvalidArgumentError
from torch_distribute.keras import saving
from torch_distribute.keras.model import Model

__all__ = ["load_model"]


def load_model(filepath: str | os.PathLike[str], custom_objects: Mapping[str, Any] | None = None,
               compile: bool = True, safe_mode: bool = True) -> Model:  # noqa: A002 - Keras' name
    """The model ``Model.save`` wrote to ``filepath``: architecture, weights and, with
    ``compile`` (when it was saved compiled), ``compile``'s configuration, the optimizer and
    its state.

    Call it inside ``strategy.scope()`` for a model of that strategy (on every worker of a
    multi-worker strategy), outside any scope for a plain one. The file's checksum is checked
    first (``CheckpointError`` for a damaged file); it is read with ``weights_only=True``, so
    reading it runs no code.

    As in Keras 3, with ``safe_mode=True`` the file may only name ``torch.nn`` / ``torch.optim``
    classes, ``torch`` functions, ``torch_distribute.keras`` objects, those in
    ``custom_objects`` (``{"Net": Net}``) and those decorated with
    ``td.keras.saving.register_serializable()``: anything else raises ``InvalidArgumentError``
    naming it, before anything is built. ``safe_mode=False`` imports whatever the file names
    (load only files you trust).

    >>> import os, tempfile, torch, torch_distribute as td
    >>> model = td.keras.Model(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)))
    >>> model.compile(optimizer="adam", loss="mse")
    >>> path = model.save(os.path.join(tempfile.mkdtemp(), "sequential.pt"))
    >>> with td.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
    ...     restored = td.keras.models.load_model(path)
    >>> type(restored.module).__name__, restored.compiled
    ('Sequential', True)
    """
    if not isinstance(compile, bool):
        raise InvalidArgumentError(f"compile must be True or False, got {compile!r}.")
    resolver = saving.Resolver(custom_objects, safe_mode)
    if context.has_strategy() and not context.in_cross_replica_context():
        raise ContextError("load_model() was called inside strategy.run(); call it in the scope, outside run().")
    filepath = os.fspath(filepath)
    holders = {"keras_model": saving.ConfigRecord(), "model": saving.ConfigRecord(),
               "optimizer": saving.ConfigRecord()}
    status = Checkpoint(**holders).read(filepath)
    if "keras_model" in status.missing:
        raise CheckpointError(
            f"{filepath!r} holds weights but no model (it was written by save_weights or a Checkpoint): "
            "build the model and call model.load_weights(path), or save it with model.save(path)."
        )
    record = holders["keras_model"].state_dict()
    compiled = compile and record["compile"] is not None
    named = saving.named_paths(record["model"])
    if compiled:
        named += saving.named_paths(record["compile"]) + [record["optimizer"]["cls"]]
    resolver.check(named)  # refuse before anything is built
    model = saving.decode(record["model"], resolver)
    if not isinstance(model, Model):
        raise CheckpointError(f"{filepath!r} rebuilt a {type(model).__name__}, not a td.keras.Model.")
    states: dict[str, Any] = {"model": holders["model"].value}
    objects: dict[str, Any] = {"model": model.weights_module}
    if compiled:
        optimizer = saving.build_optimizer(record["optimizer"], model.named_parameters(), resolver)
        model.compile(optimizer=optimizer, **saving.decode(record["compile"], resolver))
        if "optimizer" not in status.missing:
            states["optimizer"] = holders["optimizer"].value
            objects["optimizer"] = model.optimizer
    Checkpoint(**objects).load_state_dict({"save_counter": 0, "objects": states})
    return model
