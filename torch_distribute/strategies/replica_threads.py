"""Run one function on several replicas of one process, concurrently, with ``merge_call``.

Replica 0 runs on the calling thread; replicas 1..N-1 on persistent threads. A replica that
calls ``merge_call`` pauses; the *last* one to arrive runs the merge function once, in
cross-replica context, and hands each replica its part of the result, so a merge costs one
wake-up, not a round trip through a coordinator. Replicas that disagree on the number of
merge calls get ``ReplicaMismatchError``, never a hang. Torch kernels release the GIL, so
CPU replicas and CUDA devices compute in parallel; each CPU replica gets its share of the
intra-op threads so they do not oversubscribe the cores, and the serial merge gets them all.

A run can ask its replicas to take turns (``take_turns``): replica 0 runs until it pauses in a
merge or returns, then replica 1, and so on; after each merge replica 0 goes first again. A
compiled step's run whose inputs differ in kind from its last run's does (``compiled_function``),
so that dynamo traces or picks its graphs in replica 0 first, and the other replicas find them
at the front of its cache instead of each tracing its own.

Replicas that share a GPU (logical GPUs, ``td.config``) each compute on a CUDA stream of their
own. Every hand-over joins the streams: a replica's stream waits for the caller's before the
replica starts and after each merge; the caller's stream waits for the replicas' before a
merge and when ``run`` returns. So what one side wrote, the other reads complete, and a
memory block freed on one side is never reused while the other may still use it.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode, _pop_mode_temporarily

from torch_distribute import context, nest
from torch_distribute.eager import never_compiled
from torch_distribute.errors import ContextError, ReplicaMismatchError
from torch_distribute.strategies.replica_rng import ReplicaRandomMode, RunSeed
from torch_distribute.strategies.replicated_state import ReplicaTensorMode
from torch_distribute.values import regroup, select_replica

_IDLE, _RUNNING, _MERGING, _DONE = "idle", "running", "merging", "done"

_live_groups: weakref.WeakSet[ReplicaThreads] = weakref.WeakSet()


def _close_all() -> None:
    # Joining the replica threads before the interpreter tears down avoids native thread
    # pools being destroyed under threads that still hold them. Registered with atexit when
    # the first group starts (strategies/torch_patches.py lists it), not at import.
    for group in list(_live_groups):
        group.close()


def _close_all_at_exit() -> None:
    """Register ``_close_all`` with ``atexit``, once."""
    with _registration_lock:
        if not _registered:
            atexit.register(_close_all)
            _registered.append(True)


_registration_lock = threading.Lock()
_registered: list[bool] = []


class _Abort(BaseException):
    """Unwinds a replica paused in merge_call when the step failed elsewhere."""


class _ThreadState:
    """Thread-local torch state a replica must inherit from the caller."""

    def __init__(self) -> None:
        self.grad_enabled = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = {
            device_type: (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
            for device_type in ("cpu", "cuda")
        }

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            if self.inference:
                stack.enter_context(torch.inference_mode(True))
            for device_type, (enabled, dtype) in self.autocast.items():
                if enabled:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype))
            yield


class _Run:
    """Everything about one ``run`` call that the replicas and the merger need."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, strategy: context.StrategyLike,
                 replica_contexts: Sequence[context.ReplicaContextLike], modes: list[TorchFunctionMode], n: int) -> None:
        self.fn = fn
        self.args = [select_replica(k, args) for k in range(n)]
        self.kwargs = [select_replica(k, kwargs) for k in range(n)]
        self.strategy = strategy
        self.frames = context.current_frames()
        self.thread_state = _ThreadState()
        self.replica_contexts = replica_contexts
        self.modes = modes
        self.run_seed = RunSeed()
        # The caller's current stream on each GPU that replicas share: the merges run on it.
        self.home_streams: dict[torch.device, torch.cuda.Stream] = {}
        # Tensors a merge_call handed to every replica as one value (id -> tensor, held so
        # that the id is not reused while the run lasts): the strategy mirrored them.
        self.merged_tensors: dict[int, torch.Tensor] = {}

    def mirrored(self, leaf: Any) -> bool:
        """Whether the strategy itself mirrored ``leaf`` on every replica: a tensor it
        captured, or one a merge_call of this run returned to every replica."""
        return isinstance(leaf, torch.Tensor) and (
            id(leaf) in self.merged_tensors or self.strategy.extended.owns(leaf))


class ReplicaThreads:
    """A fixed group of replica threads owned by one strategy."""

    def __init__(self, devices: list[torch.device], intra_op_threads: int | None):
        self._n = len(devices)
        self._devices = devices
        self._intra_op_threads = intra_op_threads
        self._cond = threading.Condition()
        self._states = [_IDLE] * self._n
        self._results: list[Any] = [None] * self._n
        self._errors: list[BaseException | None] = [None] * self._n
        self._merge_requests: list[Any] = [None] * self._n
        self._merge_results: list[Any] = [None] * self._n
        self._failure: BaseException | None = None
        self._current: _Run | None = None
        self._pending = [False] * self._n
        self._turn: int | None = None  # the replica whose turn it is, while replicas take turns
        self._closed = False
        self._run_lock = threading.Lock()
        self._full_threads = torch.get_num_threads()
        shared = {d for d in devices if d.type == "cuda" and devices.count(d) > 1}
        self._streams = [torch.cuda.Stream(d) if d in shared else None for d in devices]
        self._ready = threading.Barrier(self._n)
        self._threads = [
            threading.Thread(target=self._loop, args=(k,), name=f"td-replica-{k}", daemon=True)
            for k in range(1, self._n)
        ]
        for thread in self._threads:
            thread.start()
        self._ready.wait()
        _close_all_at_exit()
        _live_groups.add(self)
        # torch.set_num_threads in the replica threads also changed the process-wide default
        # that new threads start from; give the caller's setting back.
        torch.set_num_threads(self._full_threads)

    # -- called by the strategy -----------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, strategy: context.StrategyLike,
            replica_contexts: Sequence[context.ReplicaContextLike], modes: list[TorchFunctionMode],
            take_turns: bool = False) -> Any:
        """Run ``fn`` on every replica; ``replica_contexts[k]``/``modes[k]`` are replica k's.
        ``take_turns``: one replica at a time (see the module docstring)."""
        if not self._run_lock.acquire(blocking=False):
            raise ContextError(
                "strategy.run() was called while another strategy.run() of the same strategy "
                "is in progress (from another thread or from inside a replica function)."
            )
        try:
            current = _Run(fn, args, kwargs, strategy, replica_contexts, modes, self._n)
            current.home_streams = {s.device: torch.cuda.current_stream(s.device) for s in self._streams if s}
            with self._cond:
                self._current = current
                self._failure = None
                self._states = [_RUNNING] * self._n
                self._results = [None] * self._n
                self._errors = [None] * self._n
                self._pending = [False] + [True] * (self._n - 1)
                self._turn = 0 if take_turns else None
                self._cond.notify_all()
            with self._intra_op(self._intra_op_threads):
                self._execute(0, current)
            with self._cond:
                self._cond.wait_for(lambda: all(s == _DONE for s in self._states))
                outputs, errors, failure = self._results, self._errors, self._failure
                self._states = [_IDLE] * self._n
                self._results = [None] * self._n
                self._errors = [None] * self._n
                self._current = None
                self._turn = None
        finally:
            self._run_lock.release()
        if failure is None:
            failure = next((e for e in errors if e is not None and not isinstance(e, _Abort)), None)
        if failure is not None:
            raise failure
        return regroup(outputs, mirrored=current.mirrored)

    # -- one replica --------------------------------------------------------------------------
    def _execute(self, k: int, current: _Run) -> None:
        saved_frames = context.current_frames()
        context.set_frames(current.frames)
        context.push_frame(current.strategy, current.replica_contexts[k])
        result, error = None, None
        try:
            with self._replica_stream(k, current), current.thread_state.applied(), \
                    self._random_mode(k, current), current.modes[k]:
                result = current.fn(*current.args[k], **current.kwargs[k])
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            error = exc
        finally:
            context.set_frames(saved_frames)
        with self._cond:
            self._results[k], self._errors[k] = result, error
            self._states[k] = _DONE
            self._pass_turn(k)
            self._abort_if_mismatched()
            self._cond.notify_all()

    def _loop(self, k: int) -> None:
        device = self._devices[k]
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if self._intra_op_threads is not None:
            torch.set_num_threads(self._intra_op_threads)
            torch.get_num_threads()  # pins the count for this thread before the caller restores
        self._ready.wait()
        while True:
            with self._cond:  # replica 0, the caller, always goes first
                self._cond.wait_for(lambda: (self._pending[k] and self._may_go_on(k)) or self._closed)
                if self._closed:
                    return
                self._pending[k] = False
                current = self._current
            self._execute(k, cast(_Run, current))  # set before a replica is marked pending
            del current

    # -- merge_call ---------------------------------------------------------------------------
    # Never traced, nor what it runs: a compiled replica step's graph ends before it. Its
    # bookkeeping, and the merge function the last replica runs for all, read what the other
    # replica threads change meanwhile, so guards on them can fail as they change (dynamo's
    # "Guard failed on the same frame it was created", met on torch 2.14).
    @never_compiled
    def merge_call(self, local_id: int, merge_fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        stream = self._streams[local_id]
        if stream is not None:
            self._current.home_streams[stream.device].wait_stream(stream)
        with self._cond:
            if self._failure is not None:
                raise _Abort()
            self._merge_requests[local_id] = (merge_fn, args, kwargs)
            self._states[local_id] = _MERGING
            self._pass_turn(local_id)
            last = all(s == _MERGING for s in self._states)
            if not last:
                self._abort_if_mismatched()
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._states[local_id] != _MERGING)
        if last:
            self._merge()
        with self._cond:
            self._cond.wait_for(lambda: self._may_go_on(local_id))
            result = self._merge_results[local_id]
            self._merge_results[local_id] = self._merge_requests[local_id] = None
        if isinstance(result, _Abort):
            raise result
        if stream is not None:
            stream.wait_stream(self._current.home_streams[stream.device])
        return result

    def _merge(self) -> None:
        """Run by the last replica to arrive: the merge function, once, cross-replica."""
        current = self._current
        requests = list(self._merge_requests)
        merge_fn = requests[0][0]
        saved_frames = context.current_frames()
        try:
            merged_args = regroup([r[1] for r in requests], mirrored=current.mirrored)
            merged_kwargs = regroup([r[2] for r in requests], mirrored=current.mirrored)
            context.set_frames(current.frames)
            context.push_frame(current.strategy, None)
            with outside_replica_mode(), self._intra_op(self._full_threads), _on_streams(current.home_streams):
                result = merge_fn(current.strategy, *merged_args, **merged_kwargs)
            results = [select_replica(k, result) for k in range(self._n)]
            for leaf in nest.leaves(result):
                if isinstance(leaf, torch.Tensor):
                    current.merged_tensors[id(leaf)] = leaf
        except BaseException as error:  # noqa: BLE001 - every replica raises it
            results = [_Abort() for _ in range(self._n)]
            with self._cond:
                self._failure = error
        finally:
            context.set_frames(saved_frames)
        with self._cond:
            self._merge_results = results
            self._states = [_RUNNING] * self._n
            if self._turn is not None:
                self._turn = 0
            self._cond.notify_all()

    def _may_go_on(self, k: int) -> bool:
        """Called with the lock held: whether replica ``k`` may start or go on computing (its
        turn, when replicas take turns, or the run failed and every replica unwinds)."""
        return self._turn is None or self._turn == k or self._failure is not None

    def _pass_turn(self, k: int) -> None:
        """Called with the lock held: replica ``k`` paused in a merge or returned."""
        if self._turn == k:
            self._turn = k + 1

    def _abort_if_mismatched(self) -> None:
        """Called with the lock held: some replicas returned while others wait in merge_call."""
        if _RUNNING in self._states or _MERGING not in self._states:
            return
        done = [k for k, s in enumerate(self._states) if s == _DONE]
        merging = [k for k, s in enumerate(self._states) if s == _MERGING]
        if self._failure is None:
            self._failure = next((self._errors[k] for k in done if self._errors[k] is not None), None)
        if self._failure is None:
            self._failure = ReplicaMismatchError(
                "Some replicas made a different number of merge_call() calls: "
                f"replica(s) {done} returned while replica(s) {merging} waited in merge_call "
                "(optimizer.step(), all_reduce, metric.result() and scheduler.step() all merge). "
                "Every replica must make the same sequence of these calls."
            )
        for k in merging:
            self._merge_results[k] = _Abort()
            self._states[k] = _RUNNING

    @contextlib.contextmanager
    def _replica_stream(self, k: int, current: _Run) -> Iterator[None]:
        """Replica ``k`` on its own stream, joined with the caller's at both ends."""
        stream = self._streams[k]
        if stream is None:
            yield
            return
        home = current.home_streams[stream.device]
        stream.wait_stream(home)
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            home.wait_stream(stream)

    def _random_mode(self, k: int, current: _Run) -> contextlib.AbstractContextManager[Any]:
        """CPU replicas share torch's default generator: each samples from its own instead.
        (A CUDA replica samples from its device's generator.)"""
        if self._devices[k].type != "cpu":
            return contextlib.nullcontext()
        return ReplicaRandomMode(current.run_seed, current.replica_contexts[k].replica_id_in_sync_group)

    @contextlib.contextmanager
    def _intra_op(self, count: int | None) -> Iterator[None]:
        if count is None or self._intra_op_threads is None:
            yield
            return
        previous = torch.get_num_threads()
        torch.set_num_threads(count)
        try:
            yield
        finally:
            torch.set_num_threads(previous)

    def close(self) -> None:
        """Stop the replica threads (idempotent); waits briefly for them to exit."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)


@contextlib.contextmanager
def _on_streams(streams: dict[torch.device, torch.cuda.Stream]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for stream in streams.values():
            stack.enter_context(torch.cuda.stream(stream))
        yield


@contextlib.contextmanager
def outside_replica_mode() -> Iterator[None]:
    """The merge works on copy 0 itself and draws from the default generator: lift this
    thread's replica substitution and replica generator, if any."""
    with contextlib.ExitStack() as stack:
        for kind in (ReplicaTensorMode, ReplicaRandomMode):
            if isinstance(_get_current_function_mode(), kind):
                stack.enter_context(_pop_mode_temporarily())
        yield
