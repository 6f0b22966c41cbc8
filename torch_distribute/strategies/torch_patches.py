"""Every change the package makes to torch, to the process and to the interpreter, in one table.

Importing ``torch_distribute`` changes none of them (``tests/test_torch_untouched.py``; what
it does set is its own: the ``torch_distribute`` logger's level from ``TD_LOG_LEVEL``). Each
is made when the feature that needs it is first used (``installed``) and undone, where that is
sound, when its last user is gone (``undone`` says when, or why not). Where torch has a public
hook, that is used instead (``TORCH_HOOKS_USED``); ``PATCHES`` are the torch objects replaced
because it has none. ``torch_target`` and ``signature`` are what each relies on in torch, as
found on the versions in ``TORCH_VERSIONS_CHECKED``: the test of this table compares them with
the installed torch, so an upgrade that changes them fails in CI, not in a user's run.

The strategy's patches (``interception.py``) are installed by ``strategy_created``, which
``Strategy.__init__`` calls, when the first strategy other than the default one is made, and
undone when the last of them is garbage-collected. An optimizer made in a scope holds its
strategy (``owner_of``), so they are never undone under an optimizer whose ``step`` is routed;
a ``ParameterServerStrategy`` is held by its ``atexit`` shutdown, so once one is made they stay.

>>> import torch_distribute as td
>>> strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
>>> strategy_patches_installed()
True
>>> sorted({change.code for change in PATCHES})
['torch_distribute.strategies.interception']
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
import weakref
from typing import TYPE_CHECKING, Any

from torch_distribute import eager
from torch_distribute.strategies import interception

if TYPE_CHECKING:
    from torch_distribute.context import StrategyLike

#: The torch versions on which every ``torch_target`` and ``signature`` below was checked: the
#: oldest supported (pyproject's ``torch>=``, the local CPU build) and the newest the index serves.
TORCH_VERSIONS_CHECKED = ("2.13", "2.14")


@dataclasses.dataclass(frozen=True)
class Change:
    """One change to torch, the process or the interpreter, and why it is made.

    >>> Change("os.environ['X']", "set", "no hook", "at a call", "never", "some.module").signature is None
    True
    """

    target: str  #: what is changed (a dotted name)
    change: str  #: what is done to it
    why: str  #: why torch (or Python) offers no public hook instead
    installed: str  #: when it is made
    undone: str  #: when it is undone, or why it is not
    code: str  #: the module that makes it
    torch_target: str | None = None  #: what in torch it relies on (dotted), if anything
    signature: str | None = None  #: ``call_shape(torch_target)`` on the versions checked


_STRATEGY = "when the first strategy other than the default one is made (strategy_created)"
_GONE = "when the last such strategy is garbage-collected"
_LAST_STRATEGY = _GONE + ", unless something has replaced it since (then it stays, and passes through)"
_INTERCEPTION = "torch_distribute.strategies.interception"
_ACROSS_REPLICAS = ("is called by every replica but must act once per training step on the gradient "
                    "summed over every replica and worker (a merge_call); torch has no hook that can "
                    "replace the call")

#: The torch objects replaced, each by a thin wrapper that calls torch's own at once outside
#: every strategy's scope (constructors) or ``run`` with several replicas (the rest).
PATCHES: tuple[Change, ...] = (
    Change("torch.optim.Optimizer.__init__", "wrapped: inside a scope, the new optimizer goes to "
           "extended.capture_optimizer, and its step/zero_grad are rebound on that instance where "
           "the strategy routes steps",
           "torch has no hook that fires when an optimizer is constructed (its hooks fire at step "
           "and state_dict), and capture must see every optimizer made in a scope, of any class",
           _STRATEGY, _LAST_STRATEGY + "; optimizers made meanwhile keep their routing (they hold "
           "their strategy alive)", _INTERCEPTION, "torch.optim.Optimizer.__init__", "(self, params, defaults)"),
    Change("torch.optim.lr_scheduler.LRScheduler.__init__", "wrapped: a scheduler of a captured "
           "optimizer goes to extended.capture_scheduler, its step rebound where steps are routed",
           "torch has no hook that fires when a scheduler is constructed", _STRATEGY, _LAST_STRATEGY,
           _INTERCEPTION, "torch.optim.lr_scheduler.LRScheduler.__init__", "(self, optimizer, last_epoch=-1)"),
    *(Change(f"torch.amp.GradScaler.{name}", "wrapped: inside run with several replicas it runs once, "
             "in a merge_call, after extended.apply_to_global_gradients (update: through "
             "extended.scaler_update, which keeps the scale of a step a fault-tolerant job dropped)",
             f"GradScaler.{name} {_ACROSS_REPLICAS} (one scale, one decision to skip)", _STRATEGY,
             _LAST_STRATEGY, _INTERCEPTION, f"torch.amp.GradScaler.{name}", signature)
      for name, signature in (("unscale_", "(self, optimizer)"), ("step", "(self, optimizer, *args, **kwargs)"),
                              ("update", "(self, new_scale=None)"))),
    *(Change(f"torch.nn.utils.clip_grad.{name} (the function inside torch's _no_grad wrapper, a "
             "closure cell)", "the cell's function wrapped: inside run with several replicas the "
             "clipping runs once, in a merge_call, on the global gradient",
             f"{name} {_ACROSS_REPLICAS}; users bind it by name before a strategy exists (from "
             "torch.nn.utils import ...), which replacing the module attribute would miss, while the "
             "cell is shared by every reference (where torch is laid out otherwise, the attributes of "
             "torch.nn.utils and torch.nn.utils.clip_grad are replaced instead)", _STRATEGY, _LAST_STRATEGY,
             _INTERCEPTION, f"torch.nn.utils.clip_grad.{name}", signature)
      for name, signature in (("clip_grad_norm_", "(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, "
                                                  "foreach=None)"),
                              ("clip_grad_value_", "(parameters, clip_value, foreach=None)"))),
    Change("torch.autograd.backward", "wrapped: inside run with several replicas the loss is first "
           "checked (loss_scaling.check_backward: not averaged over one replica's batch) and recorded "
           "(nonfinite.record_loss); Tensor.backward calls it",
           "torch has no global hook that sees the tensors handed to backward before the graph runs "
           "(tensor hooks must be put on each loss beforehand)", _STRATEGY, _LAST_STRATEGY, _INTERCEPTION,
           "torch.autograd.backward",
           "(tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None, inputs=None)"),
)

#: Process-wide settings and interpreter hooks.
PROCESS_SETTINGS: tuple[Change, ...] = (
    Change("sys.meta_path", "a finder inserted first that, when torch._dynamo is imported, wraps its "
           "loader to register never_compiled's wrapper code as skipped (torch._dynamo.decorators.skip), "
           "then takes itself out; it answers None for every other module",
           "Python has no post-import hook, and dynamo can be told to skip a code object only once it is "
           "imported (importing it costs ~1.7 s of CPU per process: it is imported only by whoever "
           "compiles; torch.compiler.disable(recursive=False) makes a new wrapper instead of marking ours)",
           "by eager.watch_for_compiler: when the first strategy is made, when td.function compiles and "
           "at the first call of a never_compiled function, only while torch._dynamo is not loaded (once "
           "it is, the skip is registered at once and no finder is needed)",
           "by itself when torch._dynamo is imported; otherwise it stays, as never_compiled functions "
           "(ReplicaContext.merge_call, the Keras probability check) run without any strategy",
           "torch_distribute.eager", "torch._dynamo.decorators.skip", "(fn=None)"),
    Change("logging.getLogger('torch._inductor.cudagraph_utils.__cudagraphs').handlers",
           "a handler added that hands inductor's 'skipping cudagraphs due to ...' to the td.function "
           "being compiled on the thread, which warns once",
           "inductor reports why it skipped CUDA graphs only on this artifact logger",
           "when the first td.function compiles",
           "when the last td.function that compiled is garbage-collected (dynamo's cache may hold its "
           "backend as long as the compiled code lives)", "torch_distribute.compiled_function",
           "torch._inductor.cudagraph_utils.cudagraphs_log"),
    Change("torch._dynamo.config.recompile_limit", "raised to 8 graphs per replica (and per network, "
           "where td.function compiles a scope's networks apart): each replica's step, and each network "
           "of a class whose forward several networks share, compiles a graph of its own",
           "torch.compile takes no per-call limit, and torch._dynamo.config.patch sets the process-wide "
           "value while it lasts, which replica threads compiling at once would undo under each other",
           "when td.function first runs strategy.run with more replicas (times networks) than the "
           "limit allows",
           "put back when the last td.function that compiled is garbage-collected, if nobody changed it "
           "since", "torch_distribute.compiled_function", "torch._dynamo.config.recompile_limit"),
    Change("atexit: collectives.store_threads._end_before_teardown", "registered once: at exit, wakes "
           "(or else ends the process before) a store call still blocked, which would abort the "
           "interpreter's teardown", "an exit-time action; registered before the first group's own "
           "handlers so that it runs after all of them", "when the first WorkerGroup starts",
           "never: it concerns the store threads of every group this process made; a no-op when none "
           "is blocked", "torch_distribute.collectives.store_threads"),
    Change("atexit: WorkerGroup._at_exit", "registered per group: the exit handshake with the other "
           "workers", "an exit-time action", "when a WorkerGroup starts", "at its close()",
           "torch_distribute.collectives.worker_group"),
    Change("os.environ['GLOO_SOCKET_IFNAME']", "set, when unset, to the interface that reaches the "
           "chief, where the job spans machines",
           "Gloo takes its interface from this variable (else from the host name, which may resolve to "
           "loopback); init_process_group takes none", "when a WorkerGroup starts",
           "never: only ever set where it was unset, and later Gloo groups of the same job (the user's "
           "own too) need the same interface", "torch_distribute.collectives.group_rendezvous"),
    Change("atexit: strategies.replica_threads._close_all", "registered once: joins the replica threads "
           "before the interpreter tears down the native thread pools under them", "an exit-time action",
           "when the first group of replica threads starts",
           "never: a no-op when no group lives (replica threads outlive their strategy until closed)",
           "torch_distribute.strategies.replica_threads"),
    Change("torch.set_num_threads", "each CPU replica thread gets its share of the intra-op threads; "
           "a merge_call and the caller get the whole count",
           "torch has only the process-wide setting, which new threads start from",
           "while replica threads start, and around each merge_call",
           "at once: the caller's count is put back", "torch_distribute.strategies.replica_threads",
           "torch.set_num_threads"),
    Change("atexit: ParameterServerStrategy.shutdown and the in-process cluster's close",
           "registered per strategy / cluster: the servers and child processes are stopped at exit",
           "an exit-time action", "when the strategy / create_in_process_cluster is made",
           "never (a no-op once shut down); it holds the strategy", "torch_distribute.strategies.parameter_server"),
    Change("os.environ['TD_JOB_SECRET']", "set to a fresh secret when the job has none",
           "the strategy made next and the child processes read the job's secret from it",
           "create_in_process_cluster", "never: the children and the strategy need it",
           "torch_distribute.ps.in_process"),
    Change("signal SIGTERM handler", "BackupAndRestore(handle_preemption) makes SIGTERM save at the next "
           "step on every worker", "preemption is a signal", "BackupAndRestore, in the main thread",
           "never: the process is meant to end after the save", "torch_distribute.fault_tolerance"),
    Change("signal SIGTERM handler (fault tolerance)", "under td.experimental.FaultTolerance, SIGTERM makes the "
           "worker leave its job at the next step boundary (exit 143) while the others go on",
           "preemption is a signal", "when a fault-tolerant strategy is made, in the main thread",
           "when its FaultTolerantTraining closes (at exit, or close()): the previous handler is put back",
           "torch_distribute.strategies.fault_tolerant"),
    Change("atexit: FaultTolerantTraining.close", "registered per fault-tolerant strategy: torchft's manager "
           "(heartbeats, server) and the worker's store stopped", "an exit-time action",
           "when a fault-tolerant strategy is made", "at its close()", "torch_distribute.strategies.fault_tolerant"),
    Change("os.environ['RUST_LOG'] and the levels of torchft's loggers ('torchft', 'torchft_quorums', "
           "'torchft_commits', 'torchft_errors')", "set, where unset, to 'error' and CRITICAL: torchft's Rust side "
           "logs every quorum on stderr, its Python side a traceback per lost worker; this package logs one line",
           "torchft reads RUST_LOG when it is imported and has no quieter setting",
           "before torchft's first import (a fault-tolerant strategy, the launcher's lighthouse)",
           "never: torchft read it at its import; a value or level the user set is left alone",
           "torch_distribute.collectives.fault_tolerant_group"),
    Change("multiprocessing's forkserver: set_forkserver_preload, and the server started",
           "the preload list set to torch, torch._dynamo and torch_distribute, and the process's forkserver started with "
           "the start-up variables of the first task it forks (os.environ holds them for that moment: "
           "multiprocessing starts the server with it)",
           "multiprocessing keeps one forkserver per process, configured process-wide",
           "when a supervisor with start_method='forkserver' (the launcher, local_cluster) forks its "
           "first task", "never: the server forks every later task and ends with the process",
           "torch_distribute.cluster.forkserver_tasks"),
    Change("signal SIGINT/SIGTERM/SIGHUP handlers", "the launcher's supervisor stops its workers",
           "signals", "while the launcher supervises", "at once: the previous handlers are put back",
           "torch_distribute.cluster.supervisor"),
    Change("os.umask", "read before a checkpoint file is written (its mode is 0o666 less the umask)",
           "Python can read the umask only by setting it, where there is no /proc/self/status",
           "at each checkpoint write", "at once (without /proc only; with it nothing is set)",
           "torch_distribute.checkpoint.file_io"),
)

#: Torch's hooks and per-call options used instead of a patch.
TORCH_HOOKS_USED: tuple[Change, ...] = (
    *(Change(f"torch.nn.modules.module.{name}", f"one global hook ({kind}): inside a scope, "
             f"extended.{capture}", "a public hook", _STRATEGY, "removed " + _GONE,
             _INTERCEPTION, f"torch.nn.modules.module.{name}", "(hook)")
      for name, kind, capture in (
          ("register_module_parameter_registration_hook", "parameters", "capture_parameter"),
          ("register_module_buffer_registration_hook", "buffers", "capture_parameter"),
          ("register_module_module_registration_hook", "submodules", "capture_submodule"))),
    Change("torch.optim.optimizer.register_optimizer_step_pre_hook", "one global hook: refuses the "
           "step of an optimizer made outside the scope that several replicas would each step",
           "a public hook", _STRATEGY, "removed " + _GONE, _INTERCEPTION,
           "torch.optim.optimizer.register_optimizer_step_pre_hook", "(hook)"),
    Change("torch._TorchCompileInductorWrapper", "td.function's backend: a mode and inductor options "
           "(cpp_wrapper for CPU replica threads) per compiled function, no global inductor config",
           "torch.compile refuses mode and options together; its own backend object takes both "
           "(private: checked here)", "per torch.compile call", "nothing to undo",
           "torch_distribute.compiled_function", "torch._TorchCompileInductorWrapper.__init__",
           "(self, mode, options, dynamic, name=None)"),
    Change("torch._inductor.compile_fx.compile_fx", "td.function's backend calls it as the wrapper above "
           "does (its config as config_patches), with inner_compile wrapped: each graph inductor builds "
           "(a step's forward, its backward when the first backward needs it) is compiled under a lock "
           "file in inductor's cache directory, so that workers on one host build it once "
           "(compile_once.py; fxgraph_cache_bypass in torch._dynamo.utils.counters tells a graph that "
           "was not cached)",
           "inductor has no hook around the compile of one graph; inner_compile is the seam compile_fx has "
           "(private: its parameters are checked in tests/test_torch_untouched.py, its defaults name a "
           "function, so no call shape is recorded)",
           "per compile, while compile_once.enabled()", "nothing to undo",
           "torch_distribute.compile_once", "torch._inductor.compile_fx.compile_fx"),
    Change("torch._inductor.compile_fx.compile_fx_inner", "called by compile_once's inner_compile with the "
           "arguments compile_fx gave it", "see compile_fx above", "per graph inductor builds",
           "nothing to undo", "torch_distribute.compile_once", "torch._inductor.compile_fx.compile_fx_inner",
           "(gm, example_inputs, compile_region_name=None, **kwargs)"),
    Change("torch._inductor.runtime.cache_dir_utils.cache_dir", "read: the lock files and their 'done' "
           "markers live in its td_compile_once/ (cleared with inductor's cache); like every call of it, "
           "it sets os.environ['TORCHINDUCTOR_CACHE_DIR'] to the directory found, as inductor's own "
           "compile does a moment later", "inductor's cache directory is only known by asking it",
           "per compile, while compile_once.enabled()", "nothing to undo", "torch_distribute.compile_once",
           "torch._inductor.runtime.cache_dir_utils.cache_dir", "()"),
)


def call_shape(function: Any) -> str:
    """``function``'s signature without annotations (which differ between torch versions that
    call it alike): parameter names, kinds and defaults.

    >>> call_shape(lambda a, b=2, *c, d, **e: None)
    '(a, b=2, *c, d, **e)'
    """
    signature = inspect.signature(function)
    parameters = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty))


_lock = threading.Lock()
# One per strategy made (other than the default one); alive while its strategy lives.
_finalizers: list[weakref.finalize[Any, Any]] = []


def strategy_created(strategy: StrategyLike) -> None:
    """Install what ``strategy`` needs (``Strategy.__init__`` calls this): ``never_compiled``
    watching for dynamo, for every strategy; ``interception.py``'s hooks and wrappers, for one
    other than the default strategy, until the last of those is garbage-collected."""
    eager.watch_for_compiler()
    if strategy.is_default:  # lives as long as the process, and needs none of them
        return
    with _lock:
        _finalizers[:] = [f for f in _finalizers if f.alive]
        finalizer = weakref.finalize(strategy, _strategy_gone)
        finalizer.atexit = False  # the interpreter's exit undoes nothing
        _finalizers.append(finalizer)
        interception.install()


def _strategy_gone() -> None:
    # A finalizer: any thread, at any allocation. Never wait for the lock: whoever holds it is
    # making a strategy (which needs the patches) or undoing them already.
    if not _lock.acquire(blocking=False):
        return
    try:
        if not any(f.alive for f in _finalizers):
            _finalizers.clear()
            interception.uninstall_if_free()
    finally:
        _lock.release()


def strategy_patches_installed() -> bool:
    """Whether the strategy's hooks and wrappers (``PATCHES``) are in force."""
    return interception.installed()
