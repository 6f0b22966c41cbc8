"""Keras metrics updated inside ``strategy.run``: sync-on-read, as ``tf.keras`` metrics are.

A custom training loop updates its metrics in the step, on every replica
(``train_accuracy.update_state(labels, logits)`` inside ``strategy.run``), and reads them
outside (``train_accuracy.result()``). One Keras metric object is shared by every replica,
and its variables are plain tensors: updated by every replica thread at once they would
lose updates, and with several workers each worker's result would be its own rows'. So, as
TensorFlow does with a metric's ``synchronization="on_read"`` variables:

- ``update_state`` inside ``run`` with several replicas accumulates the replica's own state
  (Keras' ``stateless_update_state``, from the metric's reset state): nothing is shared, and
  the metric's variables are not touched.
- ``result()`` outside ``run`` first adds what every replica of every worker accumulated to
  the metric's variables (summed, as the variables' ``aggregation="sum"`` says; with several
  workers one small collective, so every worker reads its results at the same points, as it
  does for ``td.metrics``), then is Keras' own ``result()``: the metric over every replica's
  rows, the one-device value. ``reset_state()`` outside ``run`` drops what was accumulated.
- ``result()`` inside ``run`` is the replica's own view (its own updates since the metric was
  last read or reset), as TensorFlow's is local there.

Every Keras metric made after a strategy's scope was first entered is served so
(``keras.metrics.Metric.__init__``, ``keras_seams``). What cannot be served stops by name at
its first update inside ``run`` (``KerasUnsupportedError``): a metric made before any scope was
entered with Keras imported (``check_assign``, through ``keras.Variable.assign``), a metric
variable whose aggregation is not ``"sum"``, and ``reset_state()`` inside ``run``.

Reading a metric's variables directly (``metric.total``) gives what ``result()`` last added.

>>> accumulating(object())
False
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

from torch_distribute import context
from torch_distribute.errors import ContextError, KerasUnsupportedError

_local = threading.local()  # depth of this thread's served updates (a metric inside a metric)


@contextlib.contextmanager
def _updating() -> Iterator[None]:
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def _in_served_update() -> bool:
    return getattr(_local, "depth", 0) > 0


def _replica() -> Any:
    """The replica context of a ``run`` with several replicas, else ``None``."""
    replica = context.get_replica_context()
    return replica if replica is not None and replica.num_replicas_in_sync > 1 else None


class _Accumulated:
    """What the replicas of one strategy accumulated for one metric since its last read."""

    def __init__(self, strategy: Any, zero: list[torch.Tensor]):
        self.strategy = strategy
        self.zero = zero
        self.lock = threading.Lock()
        self.by_replica: dict[int, list[torch.Tensor]] = {}


_accumulated: weakref.WeakKeyDictionary[Any, _Accumulated] = weakref.WeakKeyDictionary()


def accumulating(metric: Any) -> bool:
    """Whether ``metric`` holds replica updates that its next ``result()`` adds."""
    try:
        found = _accumulated.get(metric)
    except TypeError:
        return False
    return found is not None and bool(found.by_replica)


def serve(metric: Any, keras: ModuleType) -> None:
    """Make ``metric``'s ``update_state``/``result``/``reset_state`` sync-on-read inside
    ``strategy.run`` (set on the instance; they pass through everywhere else)."""
    update_state, result, reset_state = metric.update_state, metric.result, metric.reset_state
    ref = weakref.ref(metric)

    def served_update_state(*args: Any, **kwargs: Any) -> Any:
        replica = _replica()
        if replica is None or _in_served_update():
            return update_state(*args, **kwargs)
        return _update(ref(), keras, replica, args, kwargs)

    def served_result() -> Any:
        if _in_served_update():  # Keras' stateless_result calling it
            return result()
        replica = _replica()
        if replica is None:
            _add_accumulated(ref())
            return result()
        return _replica_result(ref(), replica)

    def served_reset_state() -> Any:
        if _replica() is not None and not _in_served_update():
            raise KerasUnsupportedError(
                f"{type(ref()).__name__}.reset_state() inside strategy.run: a metric updated by every "
                "replica is reset once, outside run (between epochs), as in TensorFlow."
            )
        with contextlib.suppress(TypeError):
            _accumulated.pop(ref(), None)
        return reset_state()

    for name, served, original in (("update_state", served_update_state, update_state),
                                   ("result", served_result, result),
                                   ("reset_state", served_reset_state, reset_state)):
        served.__doc__ = original.__doc__
        object.__setattr__(metric, name, served)  # past Keras' attribute tracking


def _update(metric: Any, keras: ModuleType, replica: Any, args: tuple, kwargs: dict) -> None:
    strategy = replica.strategy
    accumulated = _accumulated_for(metric, strategy)
    local_id = replica.local_replica_id
    device = strategy.extended.replica_devices[local_id]
    start = accumulated.by_replica.get(local_id, accumulated.zero)
    with _updating(), keras.device(str(device)):
        updated = metric.stateless_update_state(start, *args, **kwargs)
    with accumulated.lock:
        accumulated.by_replica[local_id] = [torch.as_tensor(v.value if hasattr(v, "value") else v).detach()
                                            for v in updated]


def _accumulated_for(metric: Any, strategy: Any) -> _Accumulated:
    found = _accumulated.get(metric)
    if found is not None:
        if found.strategy is not strategy:
            raise ContextError(
                f"The Keras metric {metric.name!r} holds updates from {type(found.strategy).__name__}.run "
                f"and is now updated in {type(strategy).__name__}.run: read its result() (or "
                "reset_state()) before using it under another strategy, or make one metric per strategy."
            )
        return found
    for variable in metric.variables:
        if variable.aggregation != "sum":
            raise KerasUnsupportedError(
                f"The Keras metric {metric.name!r} is updated inside {type(strategy).__name__}.run with "
                f"{strategy.num_replicas_in_sync} replicas, but its variable {variable.path!r} has "
                f"aggregation={variable.aggregation!r}: only variables summed over replicas "
                "(aggregation='sum', what Metric.add_variable gives) can be combined as one device's. "
                "Update the metric outside run, on the gathered values, or use td.metrics."
            )
    with _updating():
        zero = [torch.as_tensor(v.value if hasattr(v, "value") else v).detach()
                for v in metric.stateless_reset_state()]
    return _accumulated.setdefault(metric, _Accumulated(strategy, zero))


def _deltas(accumulated: _Accumulated, variables: list[Any], replica_ids: list[int]) -> list[torch.Tensor]:
    """Per variable: what the given replicas added since the last read, on the variable's device."""
    out = []
    for i, variable in enumerate(variables):
        target = variable.value
        total = torch.zeros_like(target)
        zero = accumulated.zero[i].to(target.device)
        for replica_id in replica_ids:
            values = accumulated.by_replica.get(replica_id)
            if values is not None:
                total = total + (values[i].to(target.device, target.dtype) - zero)
        out.append(total)
    return out


def _add_accumulated(metric: Any) -> None:
    """Add every replica's and worker's updates since the last read to the metric's variables."""
    accumulated = _accumulated.get(metric)
    if accumulated is None:
        return
    extended = accumulated.strategy.extended
    variables = list(metric.variables)
    with accumulated.lock:
        deltas = _deltas(accumulated, variables, sorted(accumulated.by_replica))
        accumulated.by_replica.clear()
    if extended.num_workers_in_sync > 1:  # every worker reads here, its updates or none
        flat = torch.cat([d.reshape(-1).to(torch.float64).cpu() for d in deltas]) if deltas else torch.zeros(0)
        total = extended.reduce_across_workers(flat.to(extended.primary_device)).cpu()
        offset = 0
        for k, delta in enumerate(deltas):
            n = delta.numel()
            deltas[k] = total[offset:offset + n].view(delta.shape).to(delta.device, delta.dtype)
            offset += n
    with torch.no_grad():
        for variable, delta in zip(variables, deltas, strict=True):
            variable.assign(variable.value + delta)


def _replica_result(metric: Any, replica: Any) -> Any:
    """Inside ``run``: the result of this replica's own updates since the last read."""
    accumulated = _accumulated.get(metric)
    if accumulated is None:
        with _updating():
            return metric.stateless_result(metric.stateless_reset_state())
    values = accumulated.by_replica.get(replica.local_replica_id, accumulated.zero)
    with _updating():
        return metric.stateless_result(values)


def check_assign(variable: Any, keras: ModuleType) -> None:
    """Refuse a metric variable (``synchronization="on_read"``) assigned inside ``run`` with
    several replicas by a metric this module does not serve (made before any scope)."""
    if (variable.synchronization != "on_read" or _in_served_update()
            or keras.src.backend.in_stateless_scope() or _replica() is None):  # KERAS_TARGETS lists it
        return
    replica = _replica()
    raise KerasUnsupportedError(
        f"The Keras metric variable {variable.path!r} is updated inside "
        f"{type(replica.strategy).__name__}.run with {replica.num_replicas_in_sync} replicas by a "
        "metric made before any strategy's scope was entered: its replicas would update one "
        "variable at once and each worker would read its own rows' result. Make the metric after "
        "(or inside) `with strategy.scope():`, and its result() will be every replica's."
    )

