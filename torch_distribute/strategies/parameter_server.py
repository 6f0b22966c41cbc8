"""``ParameterServerStrategy``: asynchronous training with parameters on parameter servers.

The cluster (``TF_CONFIG`` or a resolver) has one ``chief`` (the coordinator: it runs the
user's program), ``worker`` tasks and ``ps`` tasks; workers and parameter servers run
``td.distribute_server()``. The strategy is created on the chief only. Everything travels
over authenticated channels between the tasks (``ps/transport.py``: the job secret proved on
every connection, a MAC on every message, only the library's entry points callable); the
chief keeps the membership.

- Parameters and buffers made in ``scope()`` live on the parameter servers, round-robin,
  split along dim 0 by ``variable_partitioner`` (``td.partitioners``); the initial values
  are sent when the scope is left. Optimizers made in scope become one optimizer per shard
  on the servers (same class, same hyperparameters; learning-rate changes on the
  coordinator are sent with the next ``schedule``).
- ``td.coordinator.ClusterCoordinator(strategy).schedule(fn, args)`` runs ``fn`` on a free
  worker: it reads the current parameters, computes, and ``optimizer.step()`` pushes the
  gradients, applied on the servers at once (no worker waits for another).
- The coordinator's module objects are views of the servers' values: ``forward`` and
  ``state_dict()`` on the coordinator first read the current values, so ``td.Checkpoint``
  saves exactly what a plain module's ``state_dict`` holds (shards joined) and restores
  into any strategy; ``load_state_dict`` on the coordinator writes to the servers.
- ``sharded_variable(param)`` / ``sharded_variables(module)`` show where each variable's rows
  live (TensorFlow's ``ShardedVariable.variables``: shape, offset, ps task, values).
- Metrics made in ``scope()`` keep their state on the servers (``td.metrics.Metric``): every
  worker's updates count, at least once.

>>> import torch_distribute as td
>>> td.ParameterServerStrategy(td.cluster_resolver.SimpleClusterResolver({}))
Traceback (most recent call last):
...
torch_distribute.errors.ClusterConfigError: ParameterServerStrategy needs a cluster with a 'chief', at least one 'worker' and at least one 'ps' task (TF_CONFIG or a cluster resolver); got an empty cluster.
"""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torch_distribute.cluster import ClusterResolver, resolve_cluster
from torch_distribute.devices import LogicalDevice
from torch_distribute.errors import (
    ClusterConfigError,
    InvalidArgumentError,
    ParameterServerUnavailableError,
)
from torch_distribute.ps import chief, client, hooks, server, transport, worker
from torch_distribute.ps.sharded_variable import ShardedVariable
from torch_distribute.replica_context import ReplicaContext
from torch_distribute.strategies.base import Strategy
from torch_distribute.strategies.extended import StrategyExtended, first_tensor
from torch_distribute.strategies.parameter_server_worker import ParameterServerWorkerStrategy
from torch_distribute.strategies.single_replica import call_on_this_thread

__all__ = ["ParameterServerStrategy", "ParameterServerStrategyExtended"]


class ParameterServerStrategyExtended(StrategyExtended):
    def __init__(
        self,
        strategy: Strategy,
        resolver: ClusterResolver,
        variable_partitioner: Callable[..., Any] | None,
        rpc_timeout: float,
        startup_timeout: float,
    ):
        super().__init__(strategy, (LogicalDevice("cpu", 0),))
        spec = resolver.cluster_spec()
        self.num_ps = spec.num_tasks("ps")
        self.num_workers = spec.num_tasks("worker")
        self.rpc_timeout = rpc_timeout
        self.startup_timeout = startup_timeout
        self.registry = chief.ChiefRegistry(self.num_ps, variable_partitioner, rpc_timeout)
        self._replica_context = ReplicaContext(strategy, 0)
        self._closed = False
        #: The ``ClusterCoordinator`` of this strategy (one per strategy), once made.
        self.cluster_coordinator: Any = None
        self._on_shutdown: list[Callable[[], None]] = []
        address = server.chief_address(resolver)
        self.membership = transport.join("chief", 0, address, rpc_timeout=rpc_timeout,
                                         startup_timeout=startup_timeout,
                                         addresses=server.task_addresses(resolver))
        chief.install(self.registry)
        atexit.register(self.shutdown)
        missing = self._wait_for_parameter_servers()
        if missing:
            self.shutdown()
            raise ParameterServerUnavailableError(
                f"Parameter servers {missing} did not join the coordinator at "
                f"{address[0]}:{address[1]} within {startup_timeout:g} s. Start every ps task "
                "(each runs td.distribute_server())."
            )

    def _wait_for_parameter_servers(self) -> list[str]:
        keys = [transport.task_key("ps", i) for i in range(self.num_ps)]
        transport.wait_for(lambda: all(self.membership.current_name(k) for k in keys), self.startup_timeout)
        return [k for k in keys if not self.membership.current_name(k)]

    # -- topology ------------------------------------------------------------------------
    @property
    def is_chief(self) -> bool:
        return True

    @property
    def parameter_devices(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(client.ps_name(i) for i in range(self.num_ps))

    # -- capture -------------------------------------------------------------------------
    def capture_parameter(self, module: nn.Module, name: str, tensor: torch.Tensor, is_buffer: bool) -> None:
        self.registry.capture(tensor, is_buffer)
        # The coordinator's module reads the servers' values before forward/state_dict.
        hooks.attach(module)
        return None

    def capture_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.registry.capture_optimizer(optimizer)
        self.registry.attach_optimizer_hooks(optimizer)

    @property
    def intercepts_optimizer_steps(self) -> bool:
        return True

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, step: Callable[..., Any], closure: Callable[[], Any] | None
    ) -> Any:
        if not self.registry.manages(optimizer):  # the scope is not left yet: a local step
            return step(closure) if closure is not None else step()
        self.registry.step(optimizer)
        return None

    def scheduler_step(self, scheduler: Any, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return step(*args, **kwargs)  # the coordinator runs one replica

    def finish_scope(self) -> None:
        self.registry.materialize()

    def owns(self, obj: Any) -> bool:
        tensor = first_tensor(obj)
        return tensor is not None and self.registry.owns(tensor)

    def call_for_each_replica(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        # On the coordinator (e.g. evaluation): one replica, in this thread, current values.
        self.registry.refresh()
        return call_on_this_thread(self._replica_context, torch.device("cpu"), fn, args, kwargs)

    # -- variables on the servers (metric state, shard views) ----------------------------
    def capture_variables(self, tensors: list[torch.Tensor]) -> None:
        """Place ``tensors`` (not owned by a module, e.g. a metric's state) on the servers as
        buffers: sent when the scope is left; a scheduled function's updates come back as
        deltas, like a module's buffers."""
        for tensor in tensors:
            self.registry.capture(tensor, True)

    def variable_spec(self, tensor: torch.Tensor) -> Any:
        """The placement (``ps.variables.VarSpec``) of a tensor made in scope; ships pending ones."""
        self.registry.materialize()
        spec = self.registry.spec_of(tensor)
        if spec is None:
            raise InvalidArgumentError(
                "This tensor was not created inside ParameterServerStrategy.scope(), so it is not "
                "on the parameter servers. Create the module (or metric) inside "
                "`with strategy.scope():`.")
        return spec

    def read_variables(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The servers' current values of ``tensors`` (new tensors; ``tensors`` are left as is)."""
        specs = [self.variable_spec(t) for t in tensors]
        out = [torch.zeros(s.shape, dtype=s.dtype) for s in specs]
        client.pull(specs, out, self.rpc_timeout)
        return out

    def assign_variables(self, tensors: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Write ``values`` to the servers' copies of ``tensors``."""
        client.assign([self.variable_spec(t) for t in tensors], list(values), self.rpc_timeout)

    def add_to_variables(self, tensors: list[torch.Tensor], deltas: list[torch.Tensor]) -> None:
        """``+= deltas`` on the servers' copies of ``tensors`` (concurrent adds all count)."""
        client.push_deltas([self.variable_spec(t) for t in tensors], list(deltas), self.rpc_timeout)

    # -- shutdown ------------------------------------------------------------------------
    def add_shutdown_callback(self, callback: Callable[[], None]) -> None:
        self._on_shutdown.append(callback)

    def shutdown(self) -> None:
        """Stop the cluster: workers and parameter servers leave their serving loop."""
        if self._closed:
            return
        self._closed = True
        for callback in self._on_shutdown:
            with contextlib.suppress(Exception):
                callback()
        names = [self.membership.current_name(transport.task_key(job, i))
                 for job, count in (("worker", self.num_workers), ("ps", self.num_ps)) for i in range(count)]
        futures = []
        for name in filter(None, names):
            with contextlib.suppress(Exception):
                futures.append(transport.call_async(name, server.stop_server, timeout=5.0))
        for future in futures:
            with contextlib.suppress(Exception):
                future.wait()
        chief.install(None)
        transport.leave()


class ParameterServerStrategy(Strategy):
    """Asynchronous parameter-server training driven by a ``ClusterCoordinator``.

    Create it on the chief; every ``worker`` and ``ps`` task runs ``td.distribute_server()``.

    Args:
        cluster_resolver: the cluster (default: ``TF_CONFIG``); it needs a ``chief``, at least
            one ``worker`` and at least one ``ps``, and this task must be the chief.
        variable_partitioner: ``td.partitioners.*`` (or any ``(shape, dtype) -> [k, 1, ...]``)
            to split large parameters along dim 0 over the servers; ``None``: no split.
        rpc_timeout: seconds any single read/update RPC may take.
        startup_timeout: seconds to wait for the parameter servers to join.

    Raises:
        ClusterConfigError: a cluster without chief/worker/ps, or a task that is not the chief.
        ParameterServerUnavailableError: a parameter server did not join in time.

    Example (the chief's part of a script every task runs)::

        strategy = td.ParameterServerStrategy(
            variable_partitioner=td.partitioners.MinSizePartitioner(max_shards=2))
        coordinator = td.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            model = make_model()
            optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        variable_partitioner: Callable[..., Any] | None = None,
        *,
        rpc_timeout: float = 60.0,
        startup_timeout: float = 120.0,
    ):
        resolver = cluster_resolver or resolve_cluster()
        _validate(resolver)
        self._cluster_resolver = resolver
        self._variable_partitioner = variable_partitioner
        super().__init__(ParameterServerStrategyExtended(
            self, resolver, variable_partitioner, rpc_timeout, startup_timeout))

    @property
    def extended(self) -> ParameterServerStrategyExtended:
        return self._extended  # type: ignore[return-value]

    @property
    def cluster_resolver(self) -> ClusterResolver:
        return self._cluster_resolver

    @property
    def variable_partitioner(self) -> Callable[..., Any] | None:
        return self._variable_partitioner

    def sharded_variable(self, variable: torch.Tensor) -> ShardedVariable:
        """Where a parameter (or buffer) made in ``scope()`` lives: TensorFlow's ``ShardedVariable``.

        The returned view's ``variables`` are its shards in row order, each with ``shape``,
        ``offset`` (``(start_row, 0, ...)``), ``ps_task``, ``device``
        (``"/job:ps/replica:0/task:1/device:CPU:0"``) and ``read_value()`` (that shard's
        current value, read from its server); ``read_value()`` of the view joins them. A
        variable the partitioner did not split has one shard.

        Raises:
            InvalidArgumentError: ``variable`` was not created in this strategy's ``scope()``.

        Example::

            strategy = td.ParameterServerStrategy(
                variable_partitioner=td.partitioners.FixedShardsPartitioner(2))
            with strategy.scope():
                layer = torch.nn.Linear(16384, 8)
            [(s.shape, s.offset, s.ps_task) for s in strategy.sharded_variable(layer.weight)]
            # [((4, 16384), (0, 0), 0), ((4, 16384), (4, 0), 1)]
        """
        return ShardedVariable(self.extended.variable_spec(variable), self.extended.rpc_timeout)

    def sharded_variables(self, module: nn.Module) -> dict[str, ShardedVariable]:
        """``{name: sharded_variable(tensor)}`` for every parameter and buffer of ``module``
        (names as in ``module.state_dict()``); the module must be made in ``scope()``.

        Example::

            shards = strategy.sharded_variables(model)
            {name: len(view.variables) for name, view in shards.items()}   # shards per variable
        """
        named = [*module.named_parameters(), *module.named_buffers()]
        return {name: self.sharded_variable(tensor) for name, tensor in named}

    def td_reference(self) -> tuple[str]:
        return ("strategy",)

    def __repr__(self) -> str:
        ext = self.extended
        return f"ParameterServerStrategy(workers={ext.num_workers}, ps={ext.num_ps})"


def _validate(resolver: ClusterResolver) -> None:
    spec = resolver.validate()
    if not spec:
        raise ClusterConfigError(
            "ParameterServerStrategy needs a cluster with a 'chief', at least one 'worker' and at "
            "least one 'ps' task (TF_CONFIG or a cluster resolver); got an empty cluster."
        )
    unknown = [job for job in spec.jobs if job not in ("chief", "worker", "ps")]
    if unknown:
        raise ClusterConfigError(
            f"ParameterServerStrategy cluster jobs must be 'chief', 'worker' and 'ps'; got {unknown}."
        )
    for job in ("chief", "worker", "ps"):
        if job not in spec.jobs or spec.num_tasks(job) < 1:
            raise ClusterConfigError(
                f"ParameterServerStrategy needs at least one {job!r} task; the cluster has jobs "
                f"{ {j: spec.num_tasks(j) for j in spec.jobs} }."
            )
    if resolver.task_type != "chief":
        raise ClusterConfigError(
            f"This task is {resolver.task_type} {resolver.task_id}: only the 'chief' creates a "
            "ParameterServerStrategy (it is the coordinator). Worker and ps tasks run "
            "td.distribute_server() instead."
        )


worker.set_strategy_factory(ParameterServerWorkerStrategy)
