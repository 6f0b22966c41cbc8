"""``FullyShardedStrategy``: parameters, gradients and optimizer state sharded over workers.

One process per device, the cluster found as ``MultiWorkerMirroredStrategy`` finds it. The
engine is PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) on a ``DeviceMesh``:

- Modules made in ``scope()`` are recorded, their parameters and buffers deferred: the
  constructor's writes are recorded, not made (``deferred_init.py``), so no worker holds
  the whole model. When an optimizer is made in the scope (or the scope is left), every
  recorded module tree is sharded on the meta device: split over the model axis where a
  ``LayoutMap`` says so (torch's ``parallelize_module``, ``mesh/plan.py``), then FSDP2 on
  the submodules the shard policy picks and the root; each worker then allocates its shards
  and fills them one tensor at a time with the chief's initial values
  (``sharded_init.py``): the values one device would have built.
- The optimizer then holds the sharded parameters (DTensors): each worker keeps and updates
  only its shard of the parameters and of the optimizer state.
- In ``run``, FSDP2 gathers each sharded module's parameters for its forward and backward and
  reduce-scatters the gradients, *summed* over workers (not averaged), so the loss scaled by
  the global batch (``td.compute_average_loss``) gives the gradient one device would.
- Checkpoints are written by every worker, its own shards, with
  ``torch.distributed.checkpoint`` (``extended.checkpoint_is_sharded``).
- On a ``DeviceMesh`` with a model axis (``layout_map=``), a replica is one position along
  the batch axis: its workers read the same batch, and reductions count it once
  (``mesh/topology.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torch_distribute.cluster import ClusterResolver
from torch_distribute.collectives.communication import CommunicationOptions
from torch_distribute.collectives.failure_kind import failure_kind
from torch_distribute.collectives.worker_group import WorkerGroup
from torch_distribute.devices import DeviceLike, LogicalDevice, canonicalize
from torch_distribute.errors import InvalidArgumentError, WorkerUnavailableError
from torch_distribute.input.step_agreement import StepReport
from torch_distribute.replica_context import ReplicaContext
from torch_distribute.strategies.across_workers import (
    AcrossWorkers,
    check_implementation,
    default_worker_devices,
    open_worker_group,
    worker_job,
)
from torch_distribute.strategies.base import Strategy
from torch_distribute.strategies.deferred_init import defer, is_deferred
from torch_distribute.strategies.extended import StrategyExtended, first_tensor
from torch_distribute.strategies.mesh import (
    DeviceMesh,
    LayoutMap,
    MeshLayout,
    MeshPlace,
    TensorParallelPlan,
    check_all_matched,
    plan_for,
)
from torch_distribute.strategies.sharded_checks import ShardedStepChecks
from torch_distribute.strategies.sharded_init import TensorSources, tensors_without_values
from torch_distribute.strategies.single_replica import call_on_this_thread
from torch_distribute.values import is_dtensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

# FSDP2 and DTensor are imported where they are used (about 1 s of CPU at import): a
# program that never makes a FullyShardedStrategy does not pay for them.

ShardPolicy = Callable[[nn.Module, str], bool]

#: A submodule holding at least this many parameters is sharded on its own by the default policy.
DEFAULT_MIN_PARAMETERS = 1_000_000

_TRANSFORMER_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def default_shard_policy(module: nn.Module, name: str, parent: nn.Module | None = None) -> bool:
    """Whether a submodule is sharded on its own (the root always is).

    Yes for torch's transformer layers, for every block of an ``nn.ModuleList`` (the repeated
    blocks of a transformer or a ResNet stage) and for any submodule holding at least
    ``DEFAULT_MIN_PARAMETERS`` parameters. Each sharded submodule gathers its parameters only
    for its own forward and backward, so peak memory is about one such block.

    >>> import torch
    >>> default_shard_policy(torch.nn.TransformerEncoderLayer(8, 2), "layer")
    True
    >>> default_shard_policy(torch.nn.Linear(4, 4), "head")
    False
    """
    if not has_forward(module):
        return False
    if isinstance(module, _TRANSFORMER_LAYERS):
        return True
    if isinstance(parent, nn.ModuleList) and any(True for _ in module.parameters()):
        return True
    return sum(p.numel() for p in module.parameters()) >= DEFAULT_MIN_PARAMETERS


def has_forward(module: nn.Module) -> bool:
    """Whether ``module`` can run on its own (``nn.ModuleList``/``ModuleDict`` cannot: FSDP2
    refuses to shard such a container by itself)."""
    return type(module).forward is not nn.Module.forward


class FullyShardedExtended(AcrossWorkers, StrategyExtended):
    """The contract for FSDP2: one replica per process, state sharded over the mesh."""

    def __init__(
        self,
        strategy: Strategy,
        device: LogicalDevice,
        resolver: ClusterResolver,
        options: CommunicationOptions,
        shard_policy: ShardPolicy | None,
        reshard_after_forward: bool | int,
        mesh_shape: Sequence[int] | None,
        mixed_precision: MixedPrecisionPolicy | None,
        layout: MeshLayout | None = None,
    ):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        super().__init__(strategy, (device,))
        self._take_place(resolver)
        self._shard_policy = shard_policy
        self._reshard_after_forward = reshard_after_forward
        self._mixed_precision = mixed_precision or MixedPrecisionPolicy()
        mesh_shape = _check_mesh_shape(mesh_shape, self._num_workers) if layout is None else None
        if layout is not None:
            layout.mesh.check_workers(self._num_workers)
        self._layout = layout
        self._place = MeshPlace(layout.mesh, layout.batch_axis, self._worker_index) if layout is not None else None
        self._group = open_worker_group(resolver, options, (device,), type(strategy).__name__)
        # FSDP2's collectives run inside forward and backward: each forward, optimizer step,
        # loss-scaling check and clipping is agreed first instead (sharded_checks.py).
        self._checks = (ShardedStepChecks(self._group)
                        if self._num_workers > 1 and self._group.verifies_collectives else None)
        if layout is not None:
            # Agreed before torch makes the mesh's groups: workers with different meshes
            # would otherwise wait for each other's groups forever.
            self._agree("device mesh", layout.describe())
            self._mesh: TorchDeviceMesh = layout.mesh.build(device.torch_device.type)
            self._shard_mesh = self._mesh[layout.batch_axis]
            axes = self._place.model_axes if self._place is not None else ()
            self._model_mesh = self._mesh[axes[0]] if axes else None
        else:
            assert mesh_shape is not None, "checked above when no layout is given"
            names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
            self._mesh = init_device_mesh(device.torch_device.type, mesh_shape, mesh_dim_names=names)
            self._shard_mesh = self._mesh
            self._model_mesh = None
        replica = self._place.replica_index if self._place is not None else self._worker_index
        self._replica_context = ReplicaContext(strategy, replica)
        # Modules made in scope, in creation order, until they are sharded.
        self._pending: list[weakref.ref[nn.Module]] = []
        self._modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._roots: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        # Captured tensors by id (tensors compare by value, so no WeakSet); checked by identity.
        self._tensors: dict[int, weakref.ref[torch.Tensor]] = {}
        self._sharding = False
        self._plans: weakref.WeakKeyDictionary[nn.Module, TensorParallelPlan] = weakref.WeakKeyDictionary()
        self._matched_keys: set[str] = set()  # LayoutMap keys that matched a model sharded so far

    # -- topology --------------------------------------------------------------------------
    @property
    def worker_group(self) -> WorkerGroup:
        assert isinstance(self._group, WorkerGroup), "opened by __init__, whatever the number of workers"
        return self._group

    @property
    def mesh(self) -> TorchDeviceMesh:
        """torch's ``DeviceMesh`` the modules are sharded over (1-D, (replicate, shard), or the
        axes of the strategy's ``td.DeviceMesh``)."""
        return self._mesh

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The ``td.DeviceMesh`` given to the strategy (None: a plain data-parallel mesh)."""
        return self._layout.mesh if self._layout is not None else None

    def tensor_parallel_plan(self, module: nn.Module) -> TensorParallelPlan | None:
        """The plan ``module`` (a sharded root) was split with (None: not split over a model axis)."""
        plan = self._plans.get(module)
        return plan if plan is not None and not plan.is_empty else None

    # -- replicas on a mesh: a replica is one position along the batch axis --------------------
    @property
    def num_replicas_in_sync(self) -> int:
        return self._place.num_replicas if self._place is not None else self._num_workers

    @property
    def replica_id_offset(self) -> int:
        return self._place.replica_index if self._place is not None else self._worker_index

    @property
    def num_input_pipelines(self) -> int:
        return self.num_replicas_in_sync

    @property
    def input_pipeline_id(self) -> int:
        return self.replica_id_offset

    def _speaks_for_replica(self) -> bool:
        return self._place is None or self._place.speaks_for_replica

    def reduce_across_workers(self, tensor: torch.Tensor) -> torch.Tensor:
        # Each replica's value counts once: its tensor-parallel peers hold the same one.
        if not self._speaks_for_replica():
            tensor = torch.zeros_like(tensor)
        return super().reduce_across_workers(tensor)

    def gather_across_workers(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        if not self._speaks_for_replica():
            tensor = tensor.narrow(axis, 0, 0)
        return super().gather_across_workers(tensor, axis)

    def gather_input_reports(self, report: StepReport) -> list[StepReport]:
        # Each replica's rows count once in the step's global rows: its tensor-parallel peers
        # read the same batch.
        if not self._speaks_for_replica():
            report = StepReport(report.has_data, 0, report.digest)
        return super().gather_input_reports(report)

    @property
    def checkpoint_is_sharded(self) -> bool:
        return True

    # -- capture -----------------------------------------------------------------------------
    def capture_parameter(
        self, module: nn.Module, name: str, tensor: torch.Tensor, is_buffer: bool
    ) -> torch.Tensor | None:
        if self._sharding or is_dtensor(tensor) or module in self._roots:
            return None
        self._record(module)
        if is_deferred(tensor) or nn.parameter.is_lazy(tensor):
            self._add_tensor(tensor)
            return None
        # Its values are recorded, not made: computed one tensor at a time when sharded. On
        # this worker's device, as the mirrored strategies move a tensor when it is registered:
        # the constructor's random draws then come from that device's generator, so a GPU
        # worker builds what OneDeviceStrategy on its GPU builds for the same seed.
        deferred = defer(tensor, device=self.primary_device)
        replacement = nn.Parameter(deferred, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else deferred
        self._add_tensor(replacement)
        return replacement

    def capture_submodule(self, parent: nn.Module, name: str, child: nn.Module) -> None:
        # Containers (nn.Sequential, a model class) own no parameter of their own: they are
        # recorded when a recorded module is put in them, so the root is the whole model.
        if not self._sharding and child in self._modules:
            self._record(parent)

    def capture_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self._checks is not None:
            self._checks.watch_optimizer(optimizer)
        sharded = self._shard_pending()
        if not sharded:
            return
        replaced = 0
        for group in optimizer.param_groups:
            params = group["params"]
            for k, param in enumerate(params):
                new = sharded.get(param)
                if new is not None:
                    params[k] = new
                    replaced += 1
        if replaced and optimizer.state:
            raise InvalidArgumentError(
                "An optimizer made in FullyShardedStrategy.scope() already has state for its "
                "parameters; make it before training, or load its state after the scope."
            )

    def finish_scope(self) -> None:
        self._shard_pending()

    def owns(self, obj: Any) -> bool:
        if isinstance(obj, nn.Module):
            return obj in self._modules
        tensor = first_tensor(obj)
        if tensor is None:
            return False
        ref = self._tensors.get(id(tensor))
        return ref is not None and ref() is tensor

    # -- sharding ------------------------------------------------------------------------------
    def _add_tensor(self, tensor: torch.Tensor) -> None:
        self._tensors[id(tensor)] = weakref.ref(tensor)

    def _record(self, module: nn.Module) -> None:
        if module not in self._modules:
            self._modules.add(module)
            self._pending.append(weakref.ref(module))

    def _shard_pending(self) -> dict[nn.Parameter, nn.Parameter]:
        """Shard every recorded module tree; map each old parameter to its sharded one."""
        pending = [m for m in (ref() for ref in self._pending) if m is not None]
        self._pending.clear()
        if not pending:
            return {}
        inside = {id(sub) for m in pending for sub in m.modules() if sub is not m}
        roots = [m for m in pending if id(m) not in inside]
        old = {name_param for root in roots for name_param in _named_tensors(root)}
        # Everything is checked before anything is changed: a refusal halfway would leave the
        # model half done.
        layout_map = self._layout.layout_map if self._layout is not None else None
        plans = {root: plan_for(root, layout_map, self._batch_axis) for root in roots}
        matched = set(self._matched_keys).union(*(plan.matched_keys for plan in plans.values()))
        check_all_matched(layout_map, matched, roots)
        picked = {root: self._picked_modules(root) for root in roots}
        unset = tensors_without_values(roots)
        if unset and not all(callable(getattr(root, "init_weights", None)) for root in roots):
            raise InvalidArgumentError(
                f"{len(unset)} tensors were made on the meta device ({', '.join(unset[:3])}...), so they "
                "have no values; give the model an init_weights() method that sets them after "
                "sharding, or build it without torch.device('meta'): inside the scope nothing is "
                "allocated until it is sharded anyway.")
        sources = TensorSources.collect(roots)
        self._agree("sharded model", f"{sources.count} tensors (build {sources.signature()}); " + "; ".join(
            f"{type(root).__name__}: {plans[root].describe()}" for root in roots))
        self._matched_keys = matched
        self._sharding = True
        try:
            sources.replace_with_stand_ins()
            if self._num_workers > 1:
                sources.sync_from_chief(self.worker_group)
            for root in roots:
                class_name = type(root).__name__  # fully_shard renames the class (FSDPNet)
                if self._model_mesh is not None:
                    plans[root].apply(root, self._model_mesh)
                self._plans[root] = plans[root]
                self._shard_tree(root, picked[root])
                self._roots.add(root)
                if self._checks is not None:
                    self._checks.watch_root(root, class_name)
                for sub in root.modules():
                    self._modules.add(sub)
            for root in roots:
                root.to_empty(device=self.primary_device)
            sources.fill()
            if unset:
                for root in roots:
                    getattr(root, "init_weights")()  # noqa: B009 (a method the model may define)
        finally:
            self._sharding = False
        mapping: dict[nn.Parameter, nn.Parameter] = {}
        for root, name, tensor in old:
            if isinstance(tensor, nn.Parameter):
                parameter = root.get_parameter(name)
                self._add_tensor(parameter)
                if parameter is not tensor:
                    mapping[tensor] = parameter
            else:
                self._add_tensor(root.get_buffer(name))
        return mapping

    def _agree(self, kind: str, what: str) -> None:
        """Every worker is about to do the same ``what`` (when collectives are verified)."""
        if self._num_workers > 1 and self._group.verifies_collectives:
            self._group.agree(kind, what)

    @property
    def _batch_axis(self) -> str:
        return self._layout.batch_axis if self._layout is not None else "shard"

    def _picked_modules(self, root: nn.Module) -> list[nn.Module]:
        """The submodules the shard policy gives their own shard (checked before any sharding)."""
        picked = [
            (name, module) for name, module, parent in _post_order(root)
            if module is not root and any(True for _ in module.parameters())
            and self._wants_own_shard(module, name, parent)
        ]
        for name, module in [*picked, ("(the root)", root)]:
            if not has_forward(module):
                raise InvalidArgumentError(
                    f"The shard policy picked {name} ({type(module).__name__}), which has no "
                    "forward of its own, so FSDP2 cannot shard it by itself. Pick the blocks inside "
                    "it instead (e.g. shard_policy=lambda m, name: isinstance(m, MyBlock))."
                )
        return [m for _, m in picked]

    def _shard_tree(self, root: nn.Module, picked: list[nn.Module]) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        for module in [*picked, root]:
            fully_shard(module, mesh=self._shard_mesh, reshard_after_forward=self._reshard_after_forward,
                        mp_policy=self._mixed_precision)
        # Summed over workers, as every strategy sums gradients: the loss is already scaled
        # by the global batch (td.compute_average_loss), not by the local one.
        # Plain SUM collectives: Gloo has no pre-multiplied sum.
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)

    def _wants_own_shard(self, module: nn.Module, name: str, parent: nn.Module | None) -> bool:
        if self._shard_policy is None:
            return default_shard_policy(module, name, parent)
        return bool(self._shard_policy(module, name))

    # -- running -------------------------------------------------------------------------------
    def call_for_each_replica(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self._pending:
            self._shard_pending()
        try:
            return call_on_this_thread(self._replica_context, self.primary_device, fn, args, kwargs)
        except RuntimeError as error:
            if isinstance(error, WorkerUnavailableError) or failure_kind(error) is None:
                raise
            # A worker that died or stalled is named; any other failure is the program's own.
            missing = self._group.missing_workers()
            if missing is not None and not missing.anyone:
                raise
            raise self._group.describe_failure(
                "A fully sharded step (gather or reduce-scatter)", error, missing=missing) from error

    def apply_to_global_gradients(self, optimizer: torch.optim.Optimizer, fn: Callable[[], Any]) -> Any:
        # The gradients are already the global ones, sharded; the inf/NaN check and clipping
        # reduce over the shards, a collective of their own: agreed first.
        if self._checks is not None:
            self._checks.before_global_gradients(optimizer)
        return fn()

    # -- across workers (AcrossWorkers) --------------------------------------------------------
    @property
    def coordination_store(self) -> Any | None:
        return self._group.store

    # -- checkpoints ----------------------------------------------------------------------------
    def load_checkpoint_state(self, obj: Any, state: Any) -> Any:
        """Load sharded states as they are, whole tensors (from a plain checkpoint, or any
        other strategy's) cut to this worker's shard."""
        if isinstance(obj, nn.Module):
            current = obj.state_dict()
            state = {k: _like(v, current.get(k)) for k, v in state.items()}
            return obj.load_state_dict(state)
        if isinstance(obj, torch.optim.Optimizer) and isinstance(state, dict) and "state" in state:
            params = [p for group in obj.param_groups for p in group["params"]]
            per_param = {}
            for index, values in state["state"].items():
                param = params[index] if isinstance(index, int) and index < len(params) else None
                per_param[index] = {k: _like(v, param) for k, v in values.items()}
            return obj.load_state_dict({**state, "state": per_param})
        return obj.load_state_dict(state)

    def checkpoint_shard_templates(self, obj: Any) -> dict[tuple[Any, ...], torch.Tensor]:
        """An optimizer's state per parameter (``exp_avg``...) is sharded like the parameter."""
        if not isinstance(obj, torch.optim.Optimizer):
            return {}
        params = [p for group in obj.param_groups for p in group["params"]]
        return {("state", index): param for index, param in enumerate(params) if is_dtensor(param)}


def _like(value: Any, target: Any) -> Any:
    """``value`` cut like ``target`` when the target is sharded and the value whole."""
    if (
        is_dtensor(target) and isinstance(value, torch.Tensor) and not is_dtensor(value)
        and tuple(value.shape) == tuple(target.shape)
    ):
        whole = value.to(device=target.to_local().device, dtype=target.dtype)
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)
    return value


def _named_tensors(root: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    named = [(root, n, p) for n, p in root.named_parameters()]
    return named + [(root, n, b) for n, b in root.named_buffers()]


def _post_order(root: nn.Module) -> list[tuple[str, nn.Module, nn.Module | None]]:
    """(name, module, parent) of every module under ``root``, children before parents."""
    out: list[tuple[str, nn.Module, nn.Module | None]] = []

    def visit(name: str, module: nn.Module, parent: nn.Module | None) -> None:
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child, module)
        out.append((name, module, parent))

    visit("", root, None)
    return out


def _check_mesh_shape(mesh_shape: Sequence[int] | None, num_workers: int) -> tuple[int, ...]:
    if mesh_shape is None:
        return (num_workers,)
    shape = tuple(mesh_shape) if isinstance(mesh_shape, (tuple, list)) else ()
    if len(shape) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape):
        raise InvalidArgumentError(
            f"mesh_shape must be (replicate, shard), two positive ints, got {mesh_shape!r}; "
            f"leave it None to shard over all {num_workers} workers."
        )
    if shape[0] * shape[1] != num_workers:
        raise InvalidArgumentError(
            f"mesh_shape {shape} covers {shape[0] * shape[1]} workers but the cluster has "
            f"{num_workers}; replicate x shard must equal the number of workers."
        )
    return shape


class FullyShardedStrategy(Strategy):
    """Data parallelism with parameters, gradients and optimizer state sharded over workers.

    The same step function as every other strategy (``scope``, ``run``, ``reduce``,
    ``compute_average_loss``, distributed datasets, ``fit``); each worker holds about 1/N of
    the model and of the optimizer state. Start one process per device, as for
    ``MultiWorkerMirroredStrategy`` (``torch-distribute launch --nproc 2 train.py``).

    - ``shard_policy(module, qualified_name) -> bool``: which submodules get their own shard
      (gathered only around their own forward and backward); the default is
      ``default_shard_policy``. The root is always sharded.
    - ``reshard_after_forward``: free the gathered parameters after the forward (FSDP2's
      option; ``False`` keeps them until the backward, trading memory for a second gather).
    - ``mesh_shape=(replicate, shard)``: hybrid sharding, shards within groups of ``shard``
      workers, replicated across the ``replicate`` groups.
    - ``mixed_precision``: FSDP2's ``MixedPrecisionPolicy`` (for example bf16 parameters in
      the forward and backward, float32 gradients reduced and kept).
    - ``mesh=td.DeviceMesh((data, model), ("data", "model"))`` and
      ``layout_map=td.LayoutMap(mesh)``: tensor parallelism (Keras 3's ``ModelParallel``).
      The batch is split over ``batch_dim_name`` (the mesh's first axis by default), whose
      positions are the replicas; the layers the layout map names are split over the other
      axis (torch's ``parallelize_module``), and FSDP2 shards what each worker holds over
      the batch axis. A dict of torch ``ParallelStyle``s is accepted as the layout map too.
      See docs/strategies/tensor-parallelism.md.

    A model built in the scope is never whole on any worker: each worker allocates only its
    shards and fills them with the values one device would have built for the same seed
    (``strategies/deferred_init.py``).

    >>> import torch, torch_distribute as td
    >>> strategy = td.FullyShardedStrategy()   # no cluster: one local worker
    >>> with strategy.scope():
    ...     model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    ...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> type(model[0].weight).__name__
    'DTensor'
    >>> strategy.extended.worker_group.close()
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        shard_policy: ShardPolicy | None = None,
        reshard_after_forward: bool | int = True,
        mesh_shape: Sequence[int] | None = None,
        mixed_precision: MixedPrecisionPolicy | None = None,
        device: DeviceLike | None = None,
        mesh: DeviceMesh | None = None,
        layout_map: LayoutMap | Mapping[str, Any] | None = None,
        batch_dim_name: str | None = None,
    ):
        layout = None
        if mesh is not None or layout_map is not None or batch_dim_name is not None:
            if mesh_shape is not None:
                raise InvalidArgumentError(
                    "Give either mesh_shape (hybrid sharding) or mesh/layout_map (a named mesh), not both.")
            layout = MeshLayout.resolve(mesh, layout_map, batch_dim_name)
        resolver, options = worker_job(cluster_resolver, communication_options)
        if shard_policy is not None and not callable(shard_policy):
            raise InvalidArgumentError(
                f"shard_policy must be a callable (module, name) -> bool, got {type(shard_policy).__name__}."
            )
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
            raise InvalidArgumentError(
                "mixed_precision must be torch.distributed.fsdp.MixedPrecisionPolicy, got "
                f"{type(mixed_precision).__name__}."
            )
        chosen = canonicalize(device) if device is not None else default_worker_devices(resolver)[0]
        check_implementation(options, [chosen])
        self._cluster_resolver = resolver
        super().__init__(FullyShardedExtended(
            self, chosen, resolver, options, shard_policy, reshard_after_forward,
            mesh_shape, mixed_precision, layout,
        ))

    @property
    def cluster_resolver(self) -> ClusterResolver:
        return self._cluster_resolver

