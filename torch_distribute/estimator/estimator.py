"""``Estimator``: ``train``/``evaluate``/``predict`` with ``input_fn``, a thin layer over ``fit``.

TensorFlow's ``Estimator`` rebuilds its graph for every call and reads the latest checkpoint
from ``model_dir``; here ``model_fn`` builds a compiled ``td.keras.Model`` once per strategy
(in its scope), every call starts from the latest checkpoint in ``model_dir`` and ``train``
writes one at its end. So a model trained under ``train_distribute`` is evaluated under
``eval_distribute``, even a different strategy, through the checkpoint, as in TensorFlow.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from torch_distribute import context
from torch_distribute.checkpoint import Checkpoint, CheckpointManager, latest_checkpoint
from torch_distribute.errors import InvalidArgumentError
from torch_distribute.estimator.run_config import RunConfig
from torch_distribute.keras.callbacks.base import Callback
from torch_distribute.keras.model import Model

if TYPE_CHECKING:
    from torch_distribute.strategies import Strategy


class _StepCounter(Callback):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.steps = batch + 1


class Estimator:
    """Train, evaluate and predict a model given by ``model_fn`` on data given by ``input_fn``.

    ``model_fn(params)`` (or ``model_fn()``) returns a *compiled* ``td.keras.Model``; it is
    called inside the strategy's scope. ``input_fn()`` returns global batches: a
    ``DataLoader``, an iterable of ``(features, labels)``, or a ``(features, labels)``
    tuple of tensors (one batch). ``features`` may be a dict, passed to the model as is.

    >>> import torch, torch_distribute as td
    >>> def model_fn(params):
    ...     model = td.keras.Model(torch.nn.Linear(1, 1))
    ...     model.compile(td.keras.optimizers.SGD(params["learning_rate"]), "mse")
    ...     return model
    >>> estimator = td.estimator.Estimator(model_fn, params={"learning_rate": 0.1})
    >>> batches = [(torch.ones(10, 1), torch.ones(10, 1))] * 20
    >>> metrics = estimator.train(lambda: batches, steps=20).evaluate(lambda: batches, steps=1)
    >>> metrics["global_step"], metrics["loss"] < 0.01
    (20, True)
    """

    def __init__(self, model_fn: Callable[..., Model], model_dir: str | os.PathLike[str] | None = None,
                 config: RunConfig | None = None, params: dict[str, Any] | None = None):
        if not callable(model_fn):
            raise InvalidArgumentError(f"model_fn must be a function returning a compiled td.keras.Model, got {model_fn!r}.")
        self.config = config or RunConfig()
        directory = model_dir or self.config.model_dir
        self.model_dir = os.fspath(directory) if directory else tempfile.mkdtemp(prefix="td_estimator_")
        self.config = self.config.replace(model_dir=self.model_dir)
        self.params = dict(params or {})
        self._model_fn = model_fn
        self._models: dict[int, tuple[Any, Model, CheckpointManager, torch.Tensor]] = {}

    # -- models per strategy -------------------------------------------------------------------
    def _strategy(self, mode: str) -> Any:
        if mode == "train":
            strategy = self.config.train_distribute
        else:
            strategy = self.config.eval_distribute or self.config.train_distribute
        return strategy or context.get_strategy()

    def _build(self, strategy: Strategy) -> tuple[Model, CheckpointManager, torch.Tensor]:
        key = id(strategy)
        if key not in self._models:
            if self.config.tf_random_seed is not None:
                torch.manual_seed(self.config.tf_random_seed)
            scope = contextlib.nullcontext() if strategy.is_default else strategy.scope()
            with scope:
                takes_params = bool(inspect.signature(self._model_fn).parameters)
                model = self._model_fn(self.params) if takes_params else self._model_fn()
            if not isinstance(model, Model) or not model.compiled:
                raise InvalidArgumentError("model_fn must return a td.keras.Model on which compile() was called.")
            step = torch.zeros((), dtype=torch.int64)
            manager = CheckpointManager(Checkpoint(model=model, optimizer=model.optimizer, global_step=step),
                                        self.model_dir, max_to_keep=self.config.keep_checkpoint_max)
            self._models[key] = (strategy, model, manager, step)
        _, model, manager, step = self._models[key]
        if manager.latest_checkpoint is not None or self.latest_checkpoint() is not None:
            manager.checkpoint.restore(self.latest_checkpoint())
        return model, manager, step

    def latest_checkpoint(self) -> str | None:
        """The newest checkpoint in ``model_dir``, ``None`` before the first ``train``."""
        return latest_checkpoint(self.model_dir)

    def get_variable_value(self, name: str) -> torch.Tensor:
        """A parameter of the latest checkpoint by its ``state_dict`` name (e.g. ``"weight"``)."""
        model, _, _ = self._build(self._strategy("eval"))
        state = model.weights_module.state_dict()
        if name not in state:
            raise InvalidArgumentError(f"No variable {name!r}; variables: {sorted(state)}.")
        return state[name].detach().cpu().clone()

    # -- the API -------------------------------------------------------------------------------
    def train(self, input_fn: Callable[..., Any], steps: int | None = None, max_steps: int | None = None) -> Estimator:
        """Train ``steps`` more steps (or up to ``max_steps`` in all, or until the input ends)."""
        if steps is not None and max_steps is not None:
            raise InvalidArgumentError("Give train() steps or max_steps, not both.")
        model, manager, step = self._build(self._strategy("train"))
        if max_steps is not None:
            steps = max_steps - int(step)
            if steps <= 0:
                return self
        counter = _StepCounter()
        data = _input(input_fn)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Your input ran out of data")  # the end of input ends training
            model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[counter])
        step += counter.steps
        manager.save(checkpoint_number=int(step))
        return self

    def evaluate(self, input_fn: Callable[..., Any], steps: int | None = None, name: str | None = None) -> dict[str, Any]:
        """The loss and metrics over the input (``steps`` batches at most), with ``global_step``."""
        model, _, step = self._build(self._strategy("eval"))
        evaluated = model.evaluate(_input(input_fn), steps=steps, verbose=0, return_dict=True)
        assert isinstance(evaluated, dict)  # what return_dict=True gives
        results: dict[str, Any] = dict(evaluated)
        results["global_step"] = int(step)
        return results

    def predict(self, input_fn: Callable[..., Any], predict_keys: list[str] | None = None) -> Iterator[dict[str, Any]]:
        """One ``{"predictions": tensor}`` dict per example, in order."""
        model, _, _ = self._build(self._strategy("eval"))
        outputs = model.predict(_features_only(_input(input_fn)), verbose=0)
        named = outputs if isinstance(outputs, dict) else {"predictions": outputs}
        keys = predict_keys or list(named)
        for i in range(next(iter(named.values())).shape[0]):
            yield {k: named[k][i] for k in keys}


def _input(input_fn: Callable[..., Any]) -> Any:
    if not callable(input_fn):
        raise InvalidArgumentError(f"input_fn must be a function returning the data, got {type(input_fn).__name__}.")
    data = input_fn()
    if isinstance(data, tuple) and len(data) == 2 and not isinstance(data[0], tuple):
        return [data]  # (features, labels) tensors: one batch
    return data


def _features_only(data: Any) -> Any:
    return [batch[0] if isinstance(batch, (tuple, list)) else batch for batch in data]
