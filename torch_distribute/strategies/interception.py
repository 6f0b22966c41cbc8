"""Catching what is created inside ``strategy.scope()`` and routing optimizer steps.

This is the only module that touches torch's classes. ``strategies/torch_patches.py`` lists
what it changes and why, installs it when the first strategy is made and undoes it
(``uninstall``) when the last one is gone.

- Parameters and buffers: torch's global module registration hooks
  (``register_module_parameter_registration_hook`` / ``..._buffer_...``) hand each one to
  ``extended.capture_parameter`` of the strategy whose scope we are in; submodules
  (``register_module_module_registration_hook``) to ``extended.capture_submodule``. Both
  are also recorded in ``networks.py`` (the scope's top-level modules: where ``td.function``
  splits a step's graph).
- Optimizers and LR schedulers: torch has no hook that fires when one is constructed, so
  ``Optimizer.__init__`` and ``LRScheduler.__init__`` get a thin wrapper. Outside every
  scope it returns at once; inside, it tells the strategy (``capture_optimizer`` /
  ``capture_scheduler``).
- Steps: torch's step pre/post hooks can observe ``optimizer.step()`` but not replace it,
  and a replicated strategy must run the user's update once per training step, not once per
  replica. So, only when ``extended.intercepts_optimizer_steps``, the captured optimizer's
  ``step``/``zero_grad`` and its schedulers' ``step`` are rebound *on that instance* to the
  strategy's ``optimizer_step`` / ``optimizer_zero_grad`` / ``scheduler_step``, each given
  torch's own bound method to call.
- Loss scaling: ``torch.amp.GradScaler``'s ``unscale_``, ``step`` and ``update`` are called
  by every replica, but must act once per training step on the gradient summed over every
  replica and worker (one scale, one decision to skip). Torch has no hook on them either, so
  each gets a thin wrapper: outside ``run`` of a strategy with several replicas it calls
  torch's method at once; inside, it runs it once in a ``merge_call``, after
  ``extended.apply_to_global_gradients``.
- Gradient clipping: ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` called by
  every replica must clip the gradient summed over every replica and worker, else each
  replica clips its own and the norm is not the global one. Inside ``run`` with several
  replicas they run once in a ``merge_call`` after ``apply_to_global_gradients`` of the
  optimizers holding the parameters. Users often bind them by name (``from torch.nn.utils
  import clip_grad_norm_``) before a strategy exists, so the function that torch's
  ``_no_grad`` decorator wraps is replaced inside it: every reference, however imported,
  goes through the wrapper.
- Backward: ``torch.autograd.backward`` (which ``Tensor.backward`` calls) gets a thin
  wrapper too, for the same reason: inside ``run`` with several replicas it first hands the
  loss to ``loss_scaling.check_backward``, which refuses a loss averaged over the replica's
  own batch; everywhere else it calls torch's function at once.
- Under ``torch.compile`` every routed method runs eagerly (``eager.never_compiled``): it
  meets the other replicas, which no graph can hold, and the update must stay exact.
- A global ``register_optimizer_step_pre_hook`` refuses the step of an optimizer made
  outside the scope when several replicas would each step it.
- Scope listeners (``add_scope_listener``): a layer above the strategies (the Keras 3
  integration, ``keras3/``) is told when a scope is entered, may hold context managers open
  while it lasts, and is told of every submodule registered in it, after the strategy.

>>> import torch, torch_distribute as td
>>> strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
>>> with strategy.scope():
...     layer = torch.nn.Linear(2, 1)
...     optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
>>> owner_of(optimizer) is strategy and owner_of(layer) is strategy
True
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch.nn.modules import module as nn_module
from torch.nn.utils import clip_grad
from torch.optim import lr_scheduler
from torch.optim import optimizer as optimizer_module

from torch_distribute import context
from torch_distribute.eager import never_compiled
from torch_distribute.errors import InvalidArgumentError, UnmirroredStateError
from torch_distribute.strategies import loss_scaling, networks, nonfinite

if TYPE_CHECKING:
    from torch_distribute.strategies.extended import StrategyExtended


class ScopedStrategy(Protocol):
    """What interception uses of a ``Strategy`` (``base`` imports this module, so it cannot
    name the class): the strategies pushed on the context stack and recorded as owners.

    >>> import torch_distribute as td
    >>> td.get_strategy().extended.intercepts_optimizer_steps
    False
    """

    @property
    def is_default(self) -> bool: ...

    @property
    def num_replicas_in_sync(self) -> int: ...

    @property
    def extended(self) -> StrategyExtended: ...


class ScopeListener(Protocol):
    """What a layer above the strategies is told of scopes (``add_scope_listener``).

    >>> sorted(name for name in vars(ScopeListener) if not name.startswith("_"))
    ['scope_entered', 'submodule_captured']
    """

    def scope_entered(self, strategy: ScopedStrategy) -> AbstractContextManager[Any] | None:
        """``strategy.scope()`` is being entered: raise to refuse it, or return a context
        manager to hold open while the scope lasts."""

    def submodule_captured(self, strategy: ScopedStrategy, parent: torch.nn.Module, name: str,
                           child: torch.nn.Module) -> None:
        """``child`` was registered as ``parent.<name>`` inside the scope, after
        ``strategy.extended.capture_submodule`` saw it."""


_listeners: list[ScopeListener] = []


def add_scope_listener(listener: ScopeListener) -> None:
    """Tell ``listener`` of every scope entered and every submodule registered in one, from
    now on (once, however often it is added). Listeners are plain objects of this process:
    nothing in torch changes."""
    if not any(known is listener for known in _listeners):
        _listeners.append(listener)


@contextlib.contextmanager
def scope_listeners_entered(strategy: ScopedStrategy) -> Iterator[None]:
    """What ``Strategy.scope()`` holds open: every listener's context for this scope."""
    if strategy.is_default or not _listeners:
        yield
        return
    with contextlib.ExitStack() as stack:
        for listener in list(_listeners):
            entered = listener.scope_entered(strategy)
            if entered is not None:
                stack.enter_context(entered)
        yield


_install_lock = threading.Lock()
# What install() did, each undone by calling it (last first); empty when not installed.
_undo: list[Callable[[], None]] = []
_strategies: weakref.WeakSet[ScopedStrategy] = weakref.WeakSet()
# Objects that know their strategy without holding a captured tensor (optimizers, metrics).
_owners: weakref.WeakKeyDictionary[object, ScopedStrategy] = weakref.WeakKeyDictionary()


def register_strategy(strategy: ScopedStrategy) -> None:
    """Make ``owner_of`` consider ``strategy``'s captured tensors."""
    _strategies.add(strategy)


def owner_of(obj: object) -> ScopedStrategy | None:
    """The (non-default) strategy an object made in a scope belongs to, if any.

    Optimizers are recorded when made; a module or tensor belongs to the strategy
    that captured its parameters; an object with a ``distribute_strategy`` (a
    ``td.keras.Model``, a metric) belongs to that one.
    """
    try:
        owner = _owners.get(obj)
    except TypeError:  # not weak-referenceable
        owner = None
    if owner is None:
        owner = getattr(obj, "distribute_strategy", None)
    if owner is not None and not owner.is_default:
        return owner
    if isinstance(obj, (torch.nn.Module, torch.Tensor)):
        for strategy in list(_strategies):
            if not strategy.is_default and strategy.extended.owns(obj):
                return strategy
    return None


def scope_strategy() -> ScopedStrategy | None:
    """The non-default strategy whose scope we are directly in (not inside run), if any."""
    strategy = context.get_cross_replica_context()
    if strategy is None or strategy.is_default:
        return None
    # Only the strategies layer pushes frames: its strategies are Strategy objects.
    return cast(ScopedStrategy, strategy)


def _on_parameter(module: torch.nn.Module, name: str, param: Any) -> Any:
    strategy = scope_strategy()
    if strategy is None or param is None:
        return None
    networks.of(strategy).parameter_registered(module)
    return strategy.extended.capture_parameter(module, name, param, is_buffer=False)


def _on_buffer(module: torch.nn.Module, name: str, buffer: Any) -> Any:
    strategy = scope_strategy()
    if strategy is None or buffer is None:
        return None
    return strategy.extended.capture_parameter(module, name, buffer, is_buffer=True)


def _on_submodule(module: torch.nn.Module, name: str, submodule: Any) -> Any:
    strategy = scope_strategy()
    if strategy is not None and submodule is not None:
        _refuse_data_parallel_wrapper(module, strategy)
        networks.of(strategy).submodule_registered(module, submodule)
        strategy.extended.capture_submodule(module, name, submodule)
        for listener in list(_listeners):
            listener.submodule_captured(strategy, module, name, submodule)
    return None


def _refuse_data_parallel_wrapper(module: torch.nn.Module, strategy: ScopedStrategy) -> None:
    """A DDP (or ``nn.DataParallel``) wrapper made in a scope: the strategy already sums the
    gradients over every replica and worker, so the wrapper's own all-reduce (or scatter)
    would be work done twice, on the strategy's own process group."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    if isinstance(module, wrappers):
        raise InvalidArgumentError(
            f"{type(module).__name__} was made inside {type(strategy).__name__}.scope(): the strategy "
            "already replicates the model and sums its gradients over every replica and worker, so "
            f"{type(module).__name__}'s own gradient all-reduce would run on every step for nothing "
            "(DDP habits do not carry over). Drop the wrapper and use the module itself: "
            "model = MyModel() inside the scope, and model(x) in the step."
        )


def capture_module(module: torch.nn.Module) -> ScopedStrategy | None:
    """Hand an existing ``module`` to the strategy whose scope we are in, as if made there.

    For modules rebuilt without constructing them (unpickled: ``torch.load`` of a whole
    ``td.keras.Model``), whose parameters no registration hook saw. Every parameter, buffer
    and submodule is registered again on its parent, so the hooks capture it (and may
    replace it). Returns the strategy, or ``None`` outside every scope (nothing is done).
    """
    strategy = scope_strategy()
    if strategy is None:
        return None
    persistent = set(module.state_dict(keep_vars=True))
    # id -> (original, replacement): a tensor shared by two modules stays shared (the
    # original is held so that its id is not reused meanwhile).
    replaced: dict[int, tuple[Any, Any]] = {}
    for prefix, parent in list(module.named_modules()):
        for name, child in list(parent.named_children()):
            parent.add_module(name, child)
        for name, param in list(parent.named_parameters(recurse=False)):
            parent.register_parameter(name, replaced.get(id(param), (param, param))[1])
            replaced.setdefault(id(param), (param, getattr(parent, name)))
        for name, buffer in list(parent.named_buffers(recurse=False)):
            key = f"{prefix}.{name}" if prefix else name
            parent.register_buffer(name, replaced.get(id(buffer), (buffer, buffer))[1], persistent=key in persistent)
            replaced.setdefault(id(buffer), (buffer, getattr(parent, name)))
    return strategy


def _eager(fn: Any) -> Any:
    """``fn``, never traced by torch.compile (it runs eagerly between two graphs)."""
    return never_compiled(fn)


def _route_optimizer(optimizer: torch.optim.Optimizer, extended: StrategyExtended) -> None:
    step = optimizer.step  # torch's bound step, hooks and profiling included
    zero_grad = optimizer.zero_grad

    def routed_step(self: torch.optim.Optimizer, closure: Any = None) -> Any:
        return extended.optimizer_step(self, step, closure)

    def routed_zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        extended.optimizer_zero_grad(self, zero_grad, set_to_none)

    # Bound methods, as torch's own: LRScheduler re-wraps ``optimizer.step.__func__``.
    optimizer.step = types.MethodType(_eager(routed_step), optimizer)  # type: ignore[method-assign]
    optimizer.zero_grad = types.MethodType(_eager(routed_zero_grad), optimizer)  # type: ignore[method-assign]


def _route_scheduler(scheduler: lr_scheduler.LRScheduler, extended: StrategyExtended) -> None:
    step = scheduler.step

    def routed_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        return extended.scheduler_step(self, step, args, kwargs)

    scheduler.step = types.MethodType(_eager(routed_step), scheduler)


def _wrap_optimizer_init(original: Any) -> Any:
    @functools.wraps(original)
    def __init__(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        strategy = scope_strategy()
        if strategy is not None and self not in _owners:
            _owners[self] = strategy
            strategy.extended.capture_optimizer(self)
            if strategy.extended.intercepts_optimizer_steps:
                _route_optimizer(self, strategy.extended)

    return __init__


def _wrap_scheduler_init(original: Any) -> Any:
    @functools.wraps(original)
    def __init__(self: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        original(self, optimizer, *args, **kwargs)
        strategy = _owners.get(optimizer)
        if strategy is not None:
            strategy.extended.capture_scheduler(self)
            if strategy.extended.intercepts_optimizer_steps:
                _route_scheduler(self, strategy.extended)

    return __init__


# What torch's GradScaler raises (RuntimeError) when unscale_ or step is called twice.
_SCALER_MISUSE = ("has already been called",)


def _wrap_scaler_method(original: Any, takes_optimizer: bool) -> Any:
    @functools.wraps(original)
    def method(scaler: Any, *args: Any, **kwargs: Any) -> Any:
        replica = context.get_replica_context()
        if replica is None or replica.num_replicas_in_sync == 1 or not scaler.is_enabled():
            return original(scaler, *args, **kwargs)
        strategy = replica.strategy
        optimizer: Any = args[0] if takes_optimizer and args else kwargs.get("optimizer")
        if takes_optimizer and _owners.get(optimizer) is not strategy:
            raise UnmirroredStateError(
                f"GradScaler.{original.__name__}() was given a {type(optimizer).__name__} created "
                f"outside {type(strategy).__name__}.scope(): its gradients would not be summed "
                "across replicas before the inf/NaN check. Create the optimizer inside "
                "`with strategy.scope():`."
            )

        def call(**overrides: Any) -> Any:
            try:
                return original(scaler, *args, **{**kwargs, **overrides})
            except RuntimeError as error:  # torch's misuse errors, with what to change
                if not any(text in str(error) for text in _SCALER_MISUSE):
                    raise  # e.g. a collective that failed: the strategy names the worker
                raise InvalidArgumentError(
                    f"GradScaler.{original.__name__}() inside strategy.run(): {error} Call "
                    "scaler.unscale_(optimizer) at most once and scaler.step(optimizer) once per "
                    "training step, then scaler.update()."
                ) from error

        if not takes_optimizer:  # update(): once per step, as the strategy says (scaler_update)
            return replica.merge_call(lambda strategy: strategy.extended.scaler_update(scaler, call))
        return _once_on_global_gradients(replica, [optimizer], call)

    return _eager(method)


def _once_on_global_gradients(
    replica: context.ReplicaContextLike, optimizers: list[torch.optim.Optimizer], call: Callable[[], Any]
) -> Any:
    """``call()`` once, in a ``merge_call``, with the gradients of ``optimizers`` summed over
    every replica and worker (``extended.apply_to_global_gradients``)."""

    def once(strategy: ScopedStrategy) -> Any:
        on_global = call
        for optimizer in optimizers:
            on_global = functools.partial(strategy.extended.apply_to_global_gradients, optimizer, on_global)
        return on_global()

    return replica.merge_call(once)


def _optimizers_holding(strategy: context.StrategyLike, params: list[torch.Tensor], function: str) -> list[torch.optim.Optimizer]:
    """The optimizers made in ``strategy``'s scope that hold ``params``; every one must be held."""
    wanted = {id(p) for p in params}
    holding = []
    for optimizer, owner in list(_owners.items()):
        if owner is not strategy or not isinstance(optimizer, torch.optim.Optimizer):
            continue
        held = {id(p) for group in optimizer.param_groups for p in group["params"]} & wanted
        if held:
            holding.append(optimizer)
            wanted -= held
    if wanted:
        raise UnmirroredStateError(
            f"{function}() inside strategy.run() with {strategy.num_replicas_in_sync} replicas clips "
            "the gradient summed over every replica, which exists only for the parameters of an "
            f"optimizer created inside strategy.scope(); {len(wanted)} of the {len(params)} "
            "parameters given are in no such optimizer. Create the module and its optimizer "
            "inside `with strategy.scope():`."
        )
    return holding


def _wrap_clipping(original: Any) -> Any:
    @functools.wraps(original)
    def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        replica = context.get_replica_context()
        if replica is None or replica.num_replicas_in_sync == 1:
            return original(parameters, *args, **kwargs)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        strategy = replica.strategy
        optimizers = _optimizers_holding(strategy, params, original.__name__)

        def call() -> Any:
            with torch.no_grad():
                return original(params, *args, **kwargs)

        return _once_on_global_gradients(replica, optimizers, call)

    return _eager(clip)


def _wrap_inside_no_grad(public: Any) -> None:
    """Replace the function that torch's ``_no_grad`` decorator calls inside ``public`` by the
    clipping wrapper of it; where torch is laid out otherwise, replace the module attributes."""
    cells = public.__closure__ or ()
    inner = [c for c in cells if getattr(c.cell_contents, "__name__", None) == public.__name__]
    if len(inner) == 1 and callable(inner[0].cell_contents):
        cell, original = inner[0], inner[0].cell_contents
        wrapped = _wrap_clipping(original)
        cell.cell_contents = wrapped

        def restore_cell() -> None:
            if cell.cell_contents is wrapped:
                cell.cell_contents = original

        _undo.append(restore_cell)
        return
    for owner in (clip_grad, torch.nn.utils):
        _replace(owner, public.__name__, _wrap_clipping)


def _wrap_backward(original: Any) -> Any:
    @functools.wraps(original)
    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        replica = context.get_replica_context()
        if replica is not None and replica.num_replicas_in_sync > 1:
            grad_tensors = args[0] if args else kwargs.get("grad_tensors", kwargs.get("grad_variables"))
            loss_scaling.check_backward(replica.strategy, replica.num_replicas_in_sync, tensors, grad_tensors)
            nonfinite.record_loss(replica.strategy, replica.replica_id_in_sync_group, tensors)
        return original(tensors, *args, **kwargs)

    return _eager(backward)


def _check_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    replica = context.get_replica_context()
    if replica is not None and replica.num_replicas_in_sync > 1 and optimizer not in _owners:
        raise UnmirroredStateError(
            f"{type(optimizer).__name__}.step() was called inside strategy.run() with "
            f"{replica.num_replicas_in_sync} replicas, but the optimizer was created outside "
            "strategy.scope(): gradients would not be summed across replicas. Create the "
            "optimizer inside `with strategy.scope():`."
        )


def _replace(owner: Any, name: str, wrap: Any) -> None:
    """``owner.name = wrap(owner.name)``, undone by ``uninstall`` unless someone replaced it since."""
    original = getattr(owner, name)
    wrapped = wrap(original)
    setattr(owner, name, wrapped)

    def restore() -> None:
        if getattr(owner, name) is wrapped:
            setattr(owner, name, original)

    _undo.append(restore)


def install() -> None:
    """Install the hooks and wrappers (idempotent, thread-safe); ``strategies/torch_patches.py``
    lists them and calls this when the first strategy is made."""
    with _install_lock:
        if _undo:
            return
        for register, hook in ((nn_module.register_module_parameter_registration_hook, _on_parameter),
                               (nn_module.register_module_buffer_registration_hook, _on_buffer),
                               (nn_module.register_module_module_registration_hook, _on_submodule)):
            _undo.append(register(hook).remove)
        _undo.append(optimizer_module.register_optimizer_step_pre_hook(_check_optimizer_step).remove)
        _replace(torch.optim.Optimizer, "__init__", _wrap_optimizer_init)
        _replace(lr_scheduler.LRScheduler, "__init__", _wrap_scheduler_init)
        scaler = torch.amp.GradScaler
        _replace(scaler, "unscale_", functools.partial(_wrap_scaler_method, takes_optimizer=True))
        _replace(scaler, "step", functools.partial(_wrap_scaler_method, takes_optimizer=True))
        _replace(scaler, "update", functools.partial(_wrap_scaler_method, takes_optimizer=False))
        _wrap_inside_no_grad(clip_grad.clip_grad_norm_)
        _wrap_inside_no_grad(clip_grad.clip_grad_value_)
        _replace(torch.autograd, "backward", _wrap_backward)


def uninstall() -> bool:
    """Undo ``install``: torch's own functions and methods back in place, the hooks removed.

    A wrapper someone else has since replaced stays (theirs calls ours, which passes through
    outside every strategy). Optimizers and schedulers whose ``step`` was routed keep their
    routing: they hold their strategy. Returns whether anything was installed.
    """
    return _uninstall(blocking=True)


def uninstall_if_free() -> bool:
    """``uninstall``, unless another thread is installing or uninstalling right now (then
    ``False``): what a garbage collector's finalizer may call, in any thread, at any time."""
    return _uninstall(blocking=False)


def _uninstall(blocking: bool) -> bool:
    if not _install_lock.acquire(blocking=blocking):
        return False
    try:
        done = bool(_undo)
        while _undo:
            _undo.pop()()
        return done
    finally:
        _install_lock.release()


def installed() -> bool:
    """Whether ``install`` is in force."""
    return bool(_undo)
