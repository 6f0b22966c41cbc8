"""Reading and updating PS-held variables from the coordinator or a worker.

Every call batches the shards per parameter server: one RPC per server, all servers at once,
each with a deadline. A server that fails to answer raises ``ParameterServerCallError``
naming it, which the coordinator turns into ``ParameterServerUnavailableError``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from torch_distribute.errors import ParameterServerUnavailableError
from torch_distribute.ps import transport, variables
from torch_distribute.ps.variables import ShardSpec, VarSpec


class ParameterServerCallError(ParameterServerUnavailableError):
    """An RPC to a parameter server failed (on a worker: reported to the coordinator)."""

    def __init__(self, ps_index: int, detail: str):
        super().__init__(f"parameter server ps:{ps_index} did not answer: {detail}. If it died, its "
                         "variables are lost: restart every task and restore the last checkpoint.")
        self.ps_index = ps_index


def ps_name(index: int) -> str:
    return f"ps:{index}"


def call_all(calls: dict[int, tuple[Callable[..., Any], tuple]], timeout: float) -> dict[int, Any]:
    """Run ``{ps_index: (fn, args)}`` on every server concurrently; results by server."""
    futures = {}
    for index, (fn, args) in calls.items():
        try:
            futures[index] = transport.call_async(ps_name(index), fn, args, timeout)
        except Exception as error:  # unknown name: the server never joined or was forgotten
            raise ParameterServerCallError(index, str(error)) from error
    results = {}
    for index, future in futures.items():
        try:
            results[index] = future.wait()
        except Exception as error:
            raise ParameterServerCallError(index, str(error).splitlines()[0][:300]) from error
    return results


def _by_server(pairs: Iterable[tuple[ShardSpec, Any]]) -> dict[int, list[tuple[ShardSpec, Any]]]:
    grouped: dict[int, list[tuple[ShardSpec, Any]]] = defaultdict(list)
    for shard, value in pairs:
        grouped[shard.ps_index].append((shard, value))
    return grouped


def create(specs: list[VarSpec], values: list[torch.Tensor], timeout: float) -> None:
    pairs = [(s, (s.shard_id, spec.rows(v.detach(), s).clone(), spec.is_param and spec.requires_grad))
             for spec, v in zip(specs, values, strict=True) for s in spec.shards]
    call_all({i: (variables.create, ([item for _, item in items],)) for i, items in _by_server(pairs).items()},
             timeout)


def assign(specs: list[VarSpec], values: list[torch.Tensor], timeout: float) -> None:
    pairs = [(s, (s.shard_id, spec.rows(v.detach(), s).clone()))
             for spec, v in zip(specs, values, strict=True) for s in spec.shards]
    call_all({i: (variables.assign, ([item for _, item in items],)) for i, items in _by_server(pairs).items()},
             timeout)


def pull(specs: list[VarSpec], targets: list[torch.Tensor], timeout: float) -> None:
    """Copy the current values of ``specs`` into the full-size local ``targets``."""
    pairs = [(s, (spec, target)) for spec, target in zip(specs, targets, strict=True) for s in spec.shards]
    grouped = _by_server(pairs)
    results = call_all({i: (variables.read, ([s.shard_id for s, _ in items],)) for i, items in grouped.items()},
                       timeout)
    with torch.no_grad():
        for index, items in grouped.items():
            for (shard, (spec, target)), value in zip(items, results[index], strict=True):
                spec.rows(target, shard).copy_(value)


def read_shards(shards: list[ShardSpec], timeout: float) -> list[torch.Tensor]:
    """The current value of each of ``shards`` (its rows only), in the order given."""
    grouped = _by_server((s, k) for k, s in enumerate(shards))
    results = call_all({i: (variables.read, ([s.shard_id for s, _ in items],)) for i, items in grouped.items()},
                       timeout)
    out: list[torch.Tensor] = [torch.empty(0)] * len(shards)
    for index, items in grouped.items():
        for (_, position), value in zip(items, results[index], strict=True):
            out[position] = value
    return out


def push_gradients(specs: list[VarSpec], grads: list[torch.Tensor], timeout: float) -> None:
    pairs = [(s, (s.shard_id, spec.rows(g.detach(), s).clone()))
             for spec, g in zip(specs, grads, strict=True) for s in spec.shards]
    call_all({i: (variables.apply_gradients, ([item for _, item in items],))
              for i, items in _by_server(pairs).items()}, timeout)


def push_deltas(specs: list[VarSpec], deltas: list[torch.Tensor], timeout: float) -> None:
    pairs = [(s, (s.shard_id, spec.rows(d.detach(), s).clone()))
             for spec, d in zip(specs, deltas, strict=True) for s in spec.shards]
    call_all({i: (variables.add, ([item for _, item in items],)) for i, items in _by_server(pairs).items()},
             timeout)


def set_optimizer(specs: list[VarSpec], optimizer_class: type, hyperparameters: list[dict[str, Any]],
                  timeout: float) -> None:
    """Build the per-shard optimizers; ``hyperparameters[k]`` is for ``specs[k]``'s group."""
    calls: dict[int, list[tuple[Callable[..., Any], tuple]]] = defaultdict(list)
    for spec, hyper in zip(specs, hyperparameters, strict=True):
        for s in spec.shards:
            calls[s.ps_index].append((variables.set_optimizer, ([s.shard_id], optimizer_class, hyper)))
    # A few variables per server: one RPC per (variable, server) keeps each group's settings.
    while any(calls.values()):
        call_all({i: items.pop() for i, items in calls.items() if items}, timeout)


def set_hyperparameters(specs: list[VarSpec], hyperparameters: list[dict[str, Any]], timeout: float) -> None:
    calls: dict[int, list[tuple[Callable[..., Any], tuple]]] = defaultdict(list)
    for spec, hyper in zip(specs, hyperparameters, strict=True):
        for s in spec.shards:
            calls[s.ps_index].append((variables.set_hyperparameters, ([s.shard_id], hyper)))
    while any(calls.values()):
        call_all({i: items.pop() for i, items in calls.items() if items}, timeout)


def optimizer_states(specs: list[VarSpec], timeout: float) -> list[dict[str, Any]]:
    """Each variable's optimizer state, shards joined along dim 0 (scalars from shard 0)."""
    pairs = [(s, spec) for spec in specs for s in spec.shards]
    grouped = _by_server(pairs)
    results = call_all({i: (variables.optimizer_state, ([s.shard_id for s, _ in items],))
                        for i, items in grouped.items()}, timeout)
    per_shard: dict[int, dict[str, Any]] = {}
    for index, items in grouped.items():
        for (shard, _), state in zip(items, results[index], strict=True):
            per_shard[shard.shard_id] = state
    out = []
    for spec in specs:
        states = [per_shard[s.shard_id] for s in spec.shards]
        joined: dict[str, Any] = {}
        for key, value in states[0].items():
            if (len(states) > 1 and isinstance(value, torch.Tensor) and value.dim() > 0
                    and value.shape[1:] == torch.Size(spec.shape[1:])):
                joined[key] = torch.cat([st[key] for st in states], dim=0)
            else:
                joined[key] = value
        out.append(joined)
    return out


def load_optimizer_states(specs: list[VarSpec], states: list[dict[str, Any]], timeout: float) -> None:
    pairs = []
    for spec, state in zip(specs, states, strict=True):
        for s in spec.shards:
            part = {}
            for key, value in state.items():
                if (len(spec.shards) > 1 and isinstance(value, torch.Tensor) and value.dim() > 0
                        and value.shape == torch.Size(spec.shape)):
                    part[key] = value[s.start:s.stop].clone()
                else:
                    part[key] = value
            pairs.append((s, (s.shard_id, part)))
    call_all({i: (variables.load_optimizer_state, ([item for _, item in items],))
              for i, items in _by_server(pairs).items()}, timeout)
