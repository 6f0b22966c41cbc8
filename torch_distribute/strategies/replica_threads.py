"""Run one function on several replicas of one process, concurrently, with ``merge_call``.

One persistent thread per replica. The calling thread coordinates: it waits until every
replica has either returned or paused in ``merge_call``; when all have paused it runs the
merge function once (cross-replica context) and hands each replica its part of the result.
Replicas that disagree on the number of merge calls get ``ReplicaMismatchError``, never a
hang. Torch kernels release the GIL, so CPU replicas and CUDA devices compute in parallel;
each CPU replica thread gets its share of the intra-op threads so they do not oversubscribe
the cores.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from torch_distribute import context
from torch_distribute.errors import ContextError, ReplicaMismatchError
from torch_distribute.values import regroup, select_replica

_IDLE, _RUNNING, _MERGING, _DONE = "idle", "running", "merging", "done"


_live_groups: weakref.WeakSet[ReplicaThreads] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # Joining the replica threads before the interpreter tears down avoids native thread
    # pools being destroyed under threads that still hold them.
    for group in list(_live_groups):
        group.close()


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

    def enter(self) -> list[Any]:
        managers: list[Any] = [torch.set_grad_enabled(self.grad_enabled)]
        if self.inference:
            managers.append(torch.inference_mode(True))
        for device_type, (enabled, dtype) in self.autocast.items():
            if enabled:
                managers.append(torch.autocast(device_type, dtype=dtype))
        for manager in managers:
            manager.__enter__()
        return managers


class ReplicaThreads:
    """A fixed group of replica threads owned by one strategy."""

    def __init__(
        self,
        devices: list[torch.device],
        intra_op_threads: int | None,
    ):
        self._n = len(devices)
        self._devices = devices
        self._intra_op_threads = intra_op_threads
        self._cond = threading.Condition()
        self._states = [_IDLE] * self._n
        self._tasks: list[Any] = [None] * self._n
        self._results: list[Any] = [None] * self._n
        self._errors: list[BaseException | None] = [None] * self._n
        self._merge_requests: list[Any] = [None] * self._n
        self._merge_results: list[Any] = [None] * self._n
        self._closed = False
        self._run_lock = threading.Lock()
        self._ready = threading.Barrier(self._n + 1)
        main_thread_count = torch.get_num_threads()
        self._threads = [
            threading.Thread(target=self._loop, args=(k,), name=f"td-replica-{k}", daemon=True)
            for k in range(self._n)
        ]
        for thread in self._threads:
            thread.start()
        self._ready.wait()
        _live_groups.add(self)
        # torch.set_num_threads in the replica threads also changed the process-wide default
        # that new threads start from; give the caller's setting back.
        torch.set_num_threads(main_thread_count)

    # -- called by the strategy (cross-replica side) ----------------------------------------
    def run(
        self,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        strategy: Any,
        replica_contexts: list[context.ReplicaContext],
        modes: list[Any],
    ) -> Any:
        """Run ``fn`` on every replica; ``replica_contexts[k]``/``modes[k]`` are replica k's."""
        if not self._run_lock.acquire(blocking=False):
            raise ContextError(
                "strategy.run() was called while another strategy.run() of the same strategy "
                "is in progress (from another thread or from inside a replica function)."
            )
        try:
            return self._run(fn, args, kwargs, strategy, replica_contexts, modes)
        finally:
            self._run_lock.release()

    def _run(self, fn, args, kwargs, strategy, replica_contexts, modes) -> Any:
        frames = context.current_frames()
        thread_state = _ThreadState()
        with self._cond:
            for k in range(self._n):
                self._tasks[k] = (
                    fn,
                    select_replica(k, args),
                    select_replica(k, kwargs),
                    frames,
                    thread_state,
                    replica_contexts[k],
                    modes[k],
                )
                self._states[k] = _RUNNING
                self._results[k] = self._errors[k] = None
            self._cond.notify_all()
            failure: BaseException | None = None
            while True:
                self._cond.wait_for(lambda: _RUNNING not in self._states)
                merging = [k for k in range(self._n) if self._states[k] == _MERGING]
                if not merging:
                    break
                done = [k for k in range(self._n) if self._states[k] == _DONE]
                if failure is None and done:
                    failure = next((self._errors[k] for k in done if self._errors[k] is not None), None)
                    if failure is None:
                        failure = ReplicaMismatchError(
                            "Some replicas made a different number of merge_call() calls: "
                            f"replica(s) {done} returned while replica(s) {merging} waited in "
                            "merge_call (optimizer.step(), all_reduce, metric.result() and "
                            "scheduler.step() all merge). Every replica must make the same "
                            "sequence of these calls."
                        )
                if failure is None:
                    self._cond.release()
                    try:
                        results = self._merge(merging, strategy, frames)
                    except BaseException as error:  # noqa: BLE001 - re-raised below
                        failure = error
                    finally:
                        self._cond.acquire()
                if failure is not None:
                    results = [_Abort() for _ in merging]
                for k, result in zip(merging, results, strict=True):
                    self._merge_results[k] = result
                    self._states[k] = _RUNNING
                self._cond.notify_all()
            outputs = list(self._results)
            errors = list(self._errors)
            self._states = [_IDLE] * self._n
            self._results = [None] * self._n
            self._errors = [None] * self._n
        if failure is None:
            failure = next((e for e in errors if e is not None and not isinstance(e, _Abort)), None)
        if failure is not None:
            raise failure
        return regroup(outputs)

    def _merge(self, merging: list[int], strategy: Any, frames: list[Any]) -> list[Any]:
        requests = [self._merge_requests[k] for k in merging]
        merge_fn, _, _ = requests[0]
        merged_args = regroup([r[1] for r in requests])
        merged_kwargs = regroup([r[2] for r in requests])
        saved = context.current_frames()
        context.set_frames(frames)
        context.push_frame(strategy, None)
        try:
            result = merge_fn(strategy, *merged_args, **merged_kwargs)
        finally:
            context.set_frames(saved)
        return [select_replica(k, result) for k in range(self._n)]

    # -- called from inside a replica ---------------------------------------------------
    def merge_call(self, local_id: int, merge_fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        with self._cond:
            self._merge_requests[local_id] = (merge_fn, args, kwargs)
            self._states[local_id] = _MERGING
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._states[local_id] == _RUNNING)
            result = self._merge_results[local_id]
            self._merge_results[local_id] = self._merge_requests[local_id] = None
        if isinstance(result, _Abort):
            raise result
        return result

    # -- the replica threads ---------------------------------------------------------------
    def _loop(self, k: int) -> None:
        device = self._devices[k]
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if self._intra_op_threads is not None:
            torch.set_num_threads(self._intra_op_threads)
            torch.get_num_threads()  # pins the count for this thread before the caller restores
        self._ready.wait()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._tasks[k] is not None or self._closed)
                if self._closed:
                    return
                fn, args, kwargs, frames, thread_state, replica_context, mode = self._tasks[k]
                self._tasks[k] = None
            result, error = None, None
            context.set_frames(frames)
            context.push_frame(replica_context.strategy, replica_context)
            managers = thread_state.enter()
            try:
                with mode:
                    result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                error = exc
            finally:
                for manager in reversed(managers):
                    manager.__exit__(None, None, None)
                context.set_frames([])
            del fn, args, kwargs, frames, replica_context, mode
            with self._cond:
                self._results[k] = result
                self._errors[k] = error
                self._states[k] = _DONE
                self._cond.notify_all()

    def close(self) -> None:
        """Stop the replica threads (idempotent); waits briefly for them to exit."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)
