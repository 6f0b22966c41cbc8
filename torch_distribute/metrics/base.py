"""The sync-on-read ``Metric`` base class and the helpers every metric shares.

A ``Metric`` keeps one state slot per local replica of the strategy it was made under.
This module holds the slots, the context rules (create in ``scope()``, update inside
``run``), the cross-worker totals behind ``result()``, and ``state_dict`` /
``load_state_dict``. The concrete metrics live in ``keras_metrics`` and
``torchmetrics_adapter``.

>>> import torch, torch_distribute as td
>>> m = td.metrics.Mean()
>>> m.update_state(torch.tensor([1.0, 2.0, 3.0]))
>>> m.result()
tensor(2.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from torch_distribute.context import get_replica_context, get_strategy, has_strategy
from torch_distribute.errors import ContextError, InvalidArgumentError
from torch_distribute.strategies.parameter_server import ParameterServerStrategyExtended

__all__ = ["Metric", "acc_dtype", "as_tensor", "check_keys", "is_empty_batch"]


def acc_dtype(device: torch.device) -> torch.dtype:
    """The dtype of metric accumulators on ``device``: float64, float32 on MPS."""
    # Accumulators are float64: a float32 count stops being exact at 2**24 (16.7M samples, one
    # ImageNet-size epoch of per-pixel accuracy), after which "+1" is lost and results drift
    # with the replica count. float64 sums of counts and of integer-valued matches are exact
    # up to 2**53, so the global totals are independent of how the data was split. MPS has
    # no float64, so it falls back to float32 there.
    return torch.float32 if device.type == "mps" else torch.float64


def as_tensor(value: Any) -> torch.Tensor:
    """A detached tensor from a tensor, numpy array, list or Python number."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    return torch.as_tensor(value)


def is_empty_batch(*tensors: torch.Tensor) -> bool:
    """True when any input has a zero-size leading (batch) dimension."""
    return any(t.dim() > 0 and t.shape[0] == 0 for t in tensors)


def check_keys(owner: str, state_dict: dict[str, Any], expected: set[str]) -> None:
    """Raise ``InvalidArgumentError`` unless ``state_dict`` has exactly the ``expected`` keys."""
    keys = set(state_dict)
    if keys != expected:
        missing, unexpected = sorted(expected - keys), sorted(keys - expected)
        raise InvalidArgumentError(
            f"{owner}.load_state_dict: missing keys {missing}, unexpected keys {unexpected}."
        )


class Metric:
    """Base class of sync-on-read metrics: one state slot per local replica.

    Subclasses list their accumulators in ``_state_names``; ``update_state`` takes
    ``index = self._local_index()`` first (it enforces the context rules), then adds with
    ``self._add(index, total=..., count=...)``; ``_compute`` turns the global totals into
    the value.

    Rules (as in TensorFlow, where metric state is ``ON_READ`` + ``SUM``):

    - create the metric inside ``strategy.scope()`` (not inside ``run``);
    - call ``update_state`` inside ``strategy.run``; with several replicas, calling it in
      cross-replica context raises ``ContextError``;
    - ``result()``, ``reset_state()``, ``state_dict()`` and ``load_state_dict()`` work in
      either context; inside ``run`` every replica must call them (they ``merge_call``).

    Under ``ParameterServerStrategy`` the state lives on the parameter servers (TensorFlow
    keeps it in variables there too): a metric made in scope and passed to (or reached from)
    a scheduled function is updated by the worker in its own copy, and the function's
    changes are added to the servers' state when it ends, so every worker's updates count.
    ``result()``, ``reset_state()``, ``state_dict()`` and ``load_state_dict()`` on the
    coordinator read and write the servers' state (call ``coordinator.join()`` first to
    count every scheduled function). As in TensorFlow, delivery is at least once: a function
    re-run after its worker died is counted again only for what the dead run had already
    sent (changes are sent when a function ends, or at its first read of the parameters
    after an ``optimizer.step()``), so a function that updates a metric and then dies before
    it ends loses nothing and counts once.

    >>> import torch, torch_distribute as td
    >>> m = td.metrics.Mean()
    >>> m.update_state(torch.tensor([1.0, 2.0, 3.0]))
    >>> m.result()
    tensor(2.)
    """

    _state_names: tuple[str, ...] = ("total", "count")
    _default_name = "metric"
    _on_parameter_servers = False

    def __init__(self, name: str | None = None):
        replica = get_replica_context()
        if replica is not None and has_strategy() and replica.num_replicas_in_sync > 1:
            raise ContextError(
                f"{type(self).__name__} was created inside strategy.run(): every replica would "
                "make its own metric. Create metrics once, inside `with strategy.scope():`, "
                "and update them inside strategy.run()."
            )
        self.name = name if name is not None else self._default_name
        # Any: on the parameter-server paths its extended is a ParameterServerStrategyExtended.
        self._strategy: Any = cast(Any, get_strategy())
        self._devices = [d.torch_device for d in self._strategy.extended.worker_devices]
        self._slots: list[Any] = [self._new_slot(device) for device in self._devices]
        # Under ParameterServerStrategy the state tensors live on the servers (see the class
        # docstring): True here and in every copy a scheduled function receives.
        self._on_parameter_servers = isinstance(self._strategy.extended, ParameterServerStrategyExtended)
        if self._on_parameter_servers:
            self._check_parameter_server_support()
            self._strategy.extended.capture_variables(self._state_tensors())

    @property
    def distribute_strategy(self) -> Any:
        """The strategy this metric was created under (its replicas are that strategy's)."""
        return self._strategy

    # -- state on the parameter servers --------------------------------------------------------
    def _check_parameter_server_support(self) -> None:
        """Raise if this metric cannot keep its state on the parameter servers."""

    def _state_tensors(self) -> list[torch.Tensor]:
        return [slot[n] for slot in self._slots for n in self._state_names]

    def _on_coordinator(self) -> bool:
        """True for the coordinator's metric of a ParameterServerStrategy (not a worker's copy)."""
        return isinstance(self._strategy.extended, ParameterServerStrategyExtended)

    def _server_totals(self) -> torch.Tensor:
        values = self._strategy.extended.read_variables(self._state_tensors())
        return torch.stack([v.to(torch.float64) for v in values]).reshape(len(self._slots), -1).sum(0)

    # -- state slots -----------------------------------------------------------------------
    def _new_slot(self, device: torch.device) -> Any:
        return {n: torch.zeros((), dtype=acc_dtype(device), device=device) for n in self._state_names}

    def _add(self, index: int, **increments: torch.Tensor) -> None:
        """Add ``increments`` to slot ``index`` (the calling replica's, from ``_local_index``)."""
        slot = self._slots[index]
        if self._on_parameter_servers:
            keys = list(increments)
            deltas = [increments[k].detach().to("cpu", slot[k].dtype).reshape(slot[k].shape) for k in keys]
            if self._on_coordinator():  # straight to the servers, concurrent adds all count
                self._strategy.extended.add_to_variables([slot[k] for k in keys], deltas)
            else:  # a worker's copy: in place, sent as a delta when the function ends
                with torch.no_grad():
                    for key, delta in zip(keys, deltas, strict=True):
                        slot[key].add_(delta)
            return
        for key, inc in increments.items():
            current = slot[key]
            if current.device != inc.device:  # follow the data (e.g. default strategy + GPU)
                current = current.to(inc.device)
            slot[key] = current + inc.to(current.dtype)

    def _local_index(self) -> int:
        """Index of the slot the caller may update; enforces TF's context rules."""
        replica = self._replica_context()
        if replica is not None:
            return replica.local_replica_id
        if self._strategy.num_replicas_in_sync > 1:
            raise ContextError(
                f"{type(self).__name__}.update_state() was called in cross-replica context on a "
                f"metric of a strategy with {self._strategy.num_replicas_in_sync} replicas. As in "
                "TensorFlow (a SUM sync-on-read variable cannot be updated in cross-replica "
                "context), update metrics inside strategy.run(): call update_state() in the "
                "step function."
            )
        return 0

    def _replica_context(self) -> Any:
        """This metric's replica context if we are in one, ``None`` in cross-replica context."""
        replica = get_replica_context()
        if replica is None:
            return None  # a strategy's scope outside run, or inside merge_call
        if replica.strategy is self._strategy:
            return replica
        if not has_strategy():
            return None  # the user's loop, outside any scope: cross-replica for this metric
        raise ContextError(
            f"{type(self).__name__} {self.name!r} was created under "
            f"{type(self._strategy).__name__} but is used inside strategy.run() of "
            f"{type(replica.strategy).__name__}. Create the metric inside "
            "`with strategy.scope():` of the strategy that runs it."
        )

    def _cross_replica_call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` once in cross-replica context; inside ``run``, through ``merge_call``."""
        replica = self._replica_context()
        if replica is not None and self._strategy.num_replicas_in_sync > 1:
            return replica.merge_call(lambda _strategy: fn())
        return fn()

    def _totals(self) -> dict[str, torch.Tensor]:
        """Global totals (float64, CPU): every local slot, summed across workers too."""
        if self._on_parameter_servers and self._on_coordinator():
            return dict(zip(self._state_names, self._server_totals(), strict=True))
        local = torch.stack(
            [
                torch.stack([slot[n].detach().to("cpu", torch.float64) for n in self._state_names])
                for slot in self._slots
            ]
        ).sum(0)
        extended = self._strategy.extended
        total = extended.reduce_across_workers(local.to(self._devices[0])).to("cpu", torch.float64)
        return dict(zip(self._state_names, total, strict=True))

    def _compute(self, totals: dict[str, torch.Tensor]) -> torch.Tensor:
        """Default: ``total / count``, 0 when nothing was counted (Keras' divide_no_nan)."""
        count = totals["count"]
        return totals["total"] / count if count != 0 else torch.zeros((), dtype=torch.float64)

    # -- public API ------------------------------------------------------------------------
    def update_state(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def result(self) -> torch.Tensor:
        """The global value over every replica and worker, as a 0-dim float32 CPU tensor."""
        return self._cross_replica_call(self._result)

    def _result(self) -> Any:
        return self._compute(self._totals()).to("cpu", torch.float32)

    def reset_state(self) -> None:
        """Zero the state of every replica."""
        self._cross_replica_call(self._reset)

    reset_states = reset_state

    def _reset(self) -> None:
        if self._on_parameter_servers:
            self._assign_on_servers({})
            return
        self._slots = [self._new_slot(device) for device in self._devices]

    def _assign_on_servers(self, values: dict[str, torch.Tensor]) -> None:
        """Set the servers' state: ``values`` in the first slot, zeros everywhere else."""
        if not self._on_coordinator():
            raise InvalidArgumentError(
                f"{type(self).__name__} {self.name!r}: reset_state()/load_state_dict() inside a "
                "scheduled function would only change one worker's view of the shared state. "
                "Call them on the coordinator (e.g. after coordinator.join()).")
        tensors = self._state_tensors()
        new = [torch.zeros_like(t) for t in tensors]
        for position, key in enumerate(self._state_names):
            if key in values:
                new[position] = values[key].to(tensors[position].dtype).reshape(tensors[position].shape)
        self._strategy.extended.assign_variables(tensors, new)

    def state_dict(self) -> dict[str, Any]:
        """The aggregated totals: one logical copy, independent of the replica count."""
        return self._cross_replica_call(self._state_dict)

    def _state_dict(self) -> dict[str, Any]:
        return {k: v.clone() for k, v in self._totals().items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load totals saved by ``state_dict`` under any number of replicas or workers.

        The totals go to the first replica of the first worker and every other slot is
        zeroed, so the global totals (hence ``result()``) are exactly the saved ones.
        """
        self._cross_replica_call(lambda: self._load_state_dict(dict(state_dict)))

    def _holds_replica_zero(self) -> bool:
        return self._strategy.extended.replica_id_offset == 0

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_keys(type(self).__name__, state_dict, set(self._state_names))
        if self._on_parameter_servers:
            values = {k: as_tensor(state_dict[k]) for k in self._state_names}
            for key, value in values.items():
                if value.numel() != 1:
                    raise InvalidArgumentError(
                        f"{type(self).__name__}.load_state_dict: {key!r} must be a scalar, got "
                        f"shape {tuple(value.shape)}.")
            self._assign_on_servers(values)
            return
        self._reset()
        if self._holds_replica_zero():
            slot = self._slots[0]
            for key in self._state_names:
                value = as_tensor(state_dict[key])
                if value.numel() != 1:
                    raise InvalidArgumentError(
                        f"{type(self).__name__}.load_state_dict: {key!r} must be a scalar, got "
                        f"shape {tuple(value.shape)}."
                    )
                slot[key] = value.reshape(()).to(device=slot[key].device, dtype=slot[key].dtype)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``update_state(*args, **kwargs)`` then ``result()`` (like a Keras metric)."""
        self.update_state(*args, **kwargs)
        return self.result()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, replicas={len(self._slots)})"
