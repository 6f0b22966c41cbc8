"""``StrategyExtended``: the strategy contract (``strategy.extended``).

Everything the layers above a strategy use is a documented public member here: topology,
capture of what is made in ``scope()``, the optimizer-step seam, reductions within a process
and across workers, and what a checkpoint reads and writes. The order in which the calls
happen is in ``strategies/base.py``; ``docs/architecture.md`` has a page on adding a strategy.

>>> import torch_distribute as td
>>> extended = td.OneDeviceStrategy("cpu").extended
>>> extended.num_workers_in_sync, extended.worker_index, extended.replica_id_offset
(1, 0, 0)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torch_distribute import context
from torch_distribute.collectives.arithmetic import divide
from torch_distribute.devices import LogicalDevice, canonicalize
from torch_distribute.errors import InvalidArgumentError
from torch_distribute.input.step_agreement import StepReport
from torch_distribute.reduce_op import ReduceOp
from torch_distribute.values import (
    DistributedValues,
    Mirrored,
    PerReplica,
    check_reducible,
    check_same_layout,
    exact_tensor,
    select_replica,
)

if TYPE_CHECKING:
    from torch_distribute.strategies.fault_tolerant import FaultTolerantTraining


def first_tensor(obj: object) -> torch.Tensor | None:
    """The tensor that says whether ``obj`` was captured: the tensor itself, or a module's
    first parameter (else its first buffer)."""
    if isinstance(obj, nn.Module):
        return next(itertools.chain(obj.parameters(), obj.buffers()), None)
    return obj if isinstance(obj, torch.Tensor) else None


class StrategyExtended:
    """The lower-level API of a strategy (``strategy.extended``): the strategy contract.

    The defaults describe one worker process whose replicas share nothing: no copies, no
    cross-worker communication. Subclasses override what their strategy changes; the
    mirrored family (``strategies/replicated.py``) adds per-replica copies.
    """

    def __init__(self, strategy: context.StrategyLike, devices: tuple[LogicalDevice, ...]):
        self._strategy = strategy
        self.worker_devices: tuple[LogicalDevice, ...] = devices
        self._replica_devices = tuple(d.torch_device for d in devices)

    # -- topology: read by any layer, on any process, at any time -------------------------
    @property
    def replica_devices(self) -> tuple[torch.device, ...]:
        """The torch device of each local replica, in local replica order."""
        return self._replica_devices

    @property
    def primary_device(self) -> torch.device:
        """Where the user's tensors live and cross-replica results land."""
        return self._replica_devices[0]

    @property
    def parameter_devices(self) -> tuple[LogicalDevice, ...]:
        return self.worker_devices

    @property
    def num_local_replicas(self) -> int:
        return len(self.worker_devices)

    @property
    def num_workers_in_sync(self) -> int:
        """Worker processes whose replicas train in lockstep (1 in one process)."""
        return 1

    @property
    def worker_index(self) -> int:
        """This process's index among ``num_workers_in_sync`` (0 in one process)."""
        return 0

    @property
    def replica_id_offset(self) -> int:
        """``replica_id_in_sync_group`` of this process's first local replica."""
        return self.worker_index * self.num_local_replicas

    @property
    def num_replicas_in_sync(self) -> int:
        return self.num_workers_in_sync * self.num_local_replicas

    @property
    def num_input_pipelines(self) -> int:
        """How many different shares each global batch is cut into between processes: one per
        worker, unless workers compute one replica together (tensor parallelism), which then
        read the same share."""
        return self.num_workers_in_sync

    @property
    def input_pipeline_id(self) -> int:
        """Which of the ``num_input_pipelines`` shares this process reads."""
        return self.worker_index

    @property
    def is_chief(self) -> bool:
        return self.worker_index == 0

    @property
    def should_checkpoint(self) -> bool:
        """Whether this process writes checkpoints (every process takes part in saving)."""
        return self.is_chief

    @property
    def should_save_summary(self) -> bool:
        return self.is_chief

    # -- 1-2. scope and capture: called by interception.py on every process, in the
    #    cross-replica context of this strategy's scope ------------------------------------
    def capture_parameter(
        self, module: nn.Module, name: str, tensor: torch.Tensor, is_buffer: bool
    ) -> torch.Tensor | None:
        """``tensor`` was registered as ``module.<name>`` (a parameter or a buffer) inside
        ``scope()``.

        Return a replacement tensor to register instead (e.g. moved to the strategy's
        device), or ``None`` to keep ``tensor``.
        """
        return None

    def capture_submodule(self, parent: nn.Module, name: str, child: nn.Module) -> None:
        """``child`` was registered as ``parent.<name>`` inside ``scope()`` (a strategy that
        wraps whole models, such as fully sharded, finds the root this way)."""

    def capture_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer was created inside ``scope()`` (after its ``__init__``)."""

    def capture_scheduler(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        """An LR scheduler was created for an optimizer this strategy captured."""

    @property
    def intercepts_optimizer_steps(self) -> bool:
        """Whether captured optimizers' ``step``/``zero_grad`` must go through
        ``optimizer_step``/``optimizer_zero_grad`` (and schedulers through
        ``scheduler_step``). False: they run untouched, at no cost."""
        return False

    def finish_scope(self) -> None:
        """The outermost ``scope()`` of this strategy was left: finish what was captured."""

    @property
    def keeps_captured_tensors(self) -> bool:
        """Whether the parameters and buffers captured in ``scope()`` stay the tensors this
        strategy trains: code that holds a parameter itself rather than reading it from its
        module at each call (a Keras 3 variable holds its ``torch.nn.Parameter``) then computes
        with each replica's ``local_copies`` inside ``run`` and sees every update. False here:
        a strategy may replace a module's parameters with others (sharded or remote ones),
        which such code would never use."""
        return False

    def owns(self, obj: object) -> bool:
        """Whether ``obj`` (a tensor or a module) holds state captured by this strategy."""
        return False

    # -- 3. running: call_for_each_replica from Strategy.run on every process; the step
    #    seams from inside the replica functions (once per replica) -----------------------
    def call_for_each_replica(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Call ``fn`` once per local replica under its ``ReplicaContext``; regroup results."""
        raise NotImplementedError

    def compiling_replica_steps(self, take_turns: bool) -> None:
        """``run`` is about to call compiled replica steps (inside a ``td.function``): lay the
        replicas' state out for compiled graphs. ``take_turns``: replicas that share a device
        should run one at a time in this run, so that they share the graph the first one traces
        or picks (``compiled_function``). Nothing here."""

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, step: Callable[..., Any], closure: Callable[[], Any] | None
    ) -> Any:
        """``optimizer.step(closure)`` of a captured optimizer; ``step`` is torch's own."""
        return step(closure) if closure is not None else step()

    def optimizer_zero_grad(
        self, optimizer: torch.optim.Optimizer, zero_grad: Callable[..., Any], set_to_none: bool
    ) -> None:
        """``optimizer.zero_grad(set_to_none)`` of a captured optimizer."""
        zero_grad(set_to_none)

    def apply_to_global_gradients(self, optimizer: torch.optim.Optimizer, fn: Callable[[], Any]) -> Any:
        """Call ``fn()`` once with the ``.grad`` of ``optimizer``'s parameters holding the sum
        over every replica and worker (cross-replica context, every process), and return its
        result. Loss scaling decides finiteness there (``GradScaler.unscale_``/``step``). If
        ``fn`` did not step, every replica then reads the global gradient as ``fn`` left it
        (so ``clip_grad_norm_`` inside ``run`` clips by the global norm), and the step that
        follows applies it without summing again."""
        return fn()

    def scheduler_step(self, scheduler: Any, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``scheduler.step(*args, **kwargs)``: advance once per training step."""
        replica = context.get_replica_context()
        if replica is None or replica.num_replicas_in_sync == 1:
            return step(*args, **kwargs)
        # Every replica calls scheduler.step(); it must advance once per training step.
        return replica.merge_call(lambda _strategy: step(*args, **kwargs))

    def scaler_update(self, scaler: Any, update: Callable[..., Any]) -> Any:
        """``GradScaler.update()`` inside ``run`` with several replicas, once per step (in a
        ``merge_call``); ``update(new_scale=...)`` takes torch's arguments. Here: as called."""
        return update()

    # -- 3-4. values and reductions: every process calls them in the same order (they are
    #    collectives across workers); replica_* ones from inside merge_call -----------------
    def local_components(self, value: Any) -> list[torch.Tensor]:
        """One tensor per local replica for ``value`` (a distributed value or a plain one)."""
        if isinstance(value, DistributedValues):
            if len(value.values) != self.num_local_replicas:
                raise InvalidArgumentError(
                    f"This {type(value).__name__} has {len(value.values)} components but the "
                    f"strategy has {self.num_local_replicas} local replicas; use values produced "
                    "by this strategy's run() or distributed datasets."
                )
            return [exact_tensor(v) for v in value.values]
        return [exact_tensor(value)] * self.num_local_replicas

    def local_copies(self, obj: object) -> tuple[torch.Tensor | nn.Module, ...] | None:
        """Each local replica's copy of a captured tensor or module, else ``None``."""
        return None

    def reduce_locally(self, components: list[torch.Tensor], destination: torch.device) -> torch.Tensor:
        """SUM of the local replicas' components, on ``destination`` (a new tensor)."""
        total = components[0].to(destination, copy=True)
        for component in components[1:]:
            total.add_(component.to(destination))
        return total

    def broadcast_locally(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """``tensor`` on every local replica's device, in replica order."""
        return [tensor.to(device) for device in self._replica_devices]

    def reduce_across_workers(self, tensor: torch.Tensor) -> torch.Tensor:
        """SUM of ``tensor`` over worker processes (a new tensor; as is with one worker)."""
        return tensor

    def gather_across_workers(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        """Concatenation over worker processes along ``axis``, in worker order."""
        return tensor

    def any_worker_has_data(self, local_has_data: bool) -> bool:
        """Whether any replica of any worker still has input (one process: the local answer)."""
        return local_has_data

    def gather_input_reports(self, report: StepReport) -> list[StepReport]:
        """Every worker's report of one step of a distributed dataset, in worker order (one
        process: its own). One small collective across workers."""
        return [report]

    def all_gather_objects(self, obj: object, what: str) -> list[Any]:
        """Small picklable values from every worker, in worker order (``what`` names it in errors)."""
        return [obj]

    @property
    def coordination_store(self) -> torch.distributed.Store | None:
        """A ``torch.distributed.Store`` every worker of the job reaches, or ``None``."""
        return None

    def replica_all_reduce(self, reduce_op: ReduceOp, per_replica: list[Any]) -> list[Any]:
        """All-reduce values (each a ``PerReplica`` or plain) over all replicas; a
        ``PerReplica`` result for each (called in a ``merge_call``)."""
        out = []
        for value in per_replica:
            total = self.reduce_across_workers(self.reduce_locally(self.local_components(value), self.primary_device))
            if reduce_op is ReduceOp.MEAN:
                total = divide(total, self.num_replicas_in_sync)
            out.append(PerReplica(self.broadcast_locally(total)))
        return out

    def replica_all_gather(self, per_replica: list[Any], axis: int) -> tuple[list[Any], list[tuple[int, ...]]]:
        """Concatenate values over all replicas along ``axis``; also every replica's size
        along ``axis`` (called in a ``merge_call``)."""
        gathered, sizes = [], []
        for value in per_replica:
            components = self.local_components(value)
            local = torch.cat([c.to(self.primary_device) for c in components], dim=axis)
            local_sizes = torch.tensor([c.shape[axis] for c in components], dtype=torch.int64)
            total = self.gather_across_workers(local, axis)
            sizes.append(tuple(int(n) for n in self.gather_across_workers(local_sizes, 0)))
            gathered.append(PerReplica(self.broadcast_locally(total)))
        return gathered, sizes

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any) -> torch.Tensor:
        """Reduce a per-replica ``value`` onto ``destinations`` (a device or a tensor)."""
        return self.batch_reduce_to(reduce_op, [(value, destinations)])[0]

    def batch_reduce_to(self, reduce_op: ReduceOp | str, value_destination_pairs: Iterable[tuple[Any, Any]]) -> list[torch.Tensor]:
        """``reduce_to`` for several (value, destination) pairs."""
        op = ReduceOp.from_value(reduce_op)
        pairs = list(value_destination_pairs)
        for value, _ in pairs:  # every value, before any collective: workers stay in step
            check_reducible(value, "extended.reduce_to")
        out = []
        for value, destination in pairs:
            device = self._device_of(destination)
            if isinstance(value, Mirrored) and op is ReduceOp.MEAN:
                out.append(exact_tensor(value.values[0]).to(device))
                continue
            # A plain value stands for every local replica's value at once: summing it over
            # several local replicas would count it N times. (With one local replica it is
            # that replica's value, summed across workers as TF does.)
            if not isinstance(value, DistributedValues) and op is ReduceOp.SUM and self.num_local_replicas > 1:
                if isinstance(value, (int, float)) and value == 0:
                    out.append(exact_tensor(value).to(device))
                    continue
                if not (isinstance(value, torch.Tensor) and self.owns(value)):
                    raise InvalidArgumentError(
                        "Cannot SUM-reduce a value that is not a distributed value (it is the same "
                        "on every replica, so the sum would count it N times). Reduce the "
                        "PerReplica value returned by strategy.run(), or use ReduceOp.MEAN."
                    )
            components = self.local_components(value)
            check_same_layout(components, "extended.reduce_to")
            if len(components) == 1:  # nothing to combine locally
                total = components[0].to(device, copy=True)
            else:
                total = self.reduce_locally(components, device)
            total = self.reduce_across_workers(total)
            out.append(divide(total, self.num_replicas_in_sync) if op is ReduceOp.MEAN else total)
        return out

    def update(self, var: torch.Tensor, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, group: bool = True) -> Any:
        """Apply ``fn(copy, *args)`` to every replica's copy of ``var`` (cross-replica context).

        ``PerReplica``/``Mirrored`` arguments are split so each copy gets its own component.
        """
        kwargs = kwargs or {}
        copies = self.local_copies(var) or (var,)
        with torch.no_grad():
            results = [
                fn(replica_copy, *select_replica(k, args), **select_replica(k, kwargs))
                for k, replica_copy in enumerate(copies)
            ]
        self.after_update(var)
        if group:
            return results[0] if all(r is results[0] for r in results) else Mirrored(results)
        return results

    def after_update(self, var: torch.Tensor) -> None:
        """``update`` changed every copy of ``var`` alike: nothing to re-broadcast."""

    # -- per-step fault tolerance: read by fit (keras/training_loops.py) -------------------
    @property
    def fault_tolerance(self) -> FaultTolerantTraining | None:
        """This strategy's per-step fault tolerance (``td.experimental.FaultTolerance``): its
        epoch loop, the keys of the datasets made and the state a joining worker receives.
        ``None`` here: a strategy without it."""
        return None

    # -- 5. checkpoints: called by td.Checkpoint on every process that saves or restores ---
    @property
    def checkpoint_is_sharded(self) -> bool:
        """Whether ``checkpoint_state`` gives sharded tensors (DTensors): then every worker
        writes its own shards (``torch.distributed.checkpoint``), not the chief alone."""
        return False

    def checkpoint_state(self, obj: Any) -> Any:
        """What a checkpoint saves for ``obj`` (a module, optimizer, scheduler...)."""
        return obj.state_dict()

    def load_checkpoint_state(self, obj: Any, state: Any) -> Any:
        """Restore what ``checkpoint_state`` gave, saved under any strategy or none."""
        return obj.load_state_dict(state)

    def checkpoint_shard_templates(self, obj: Any) -> dict[tuple[Any, ...], torch.Tensor]:
        """Sharded tensors to read ``obj``'s saved state like, where ``obj`` has none yet (an
        optimizer before its first step): ``{path in its state: tensor}``. A sharded restore
        reads every saved tensor under such a path whose shape is the template's as a shard
        of it (only this worker's part), not whole. None here."""
        return {}

    # -- helpers -------------------------------------------------------------------------------
    def _device_of(self, destination: Any) -> torch.device:
        if destination is None:
            return self.primary_device
        if isinstance(destination, torch.Tensor):
            return destination.device
        if isinstance(destination, torch.device):
            return destination
        return canonicalize(destination).torch_device
