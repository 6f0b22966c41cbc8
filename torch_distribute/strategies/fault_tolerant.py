"""``td.experimental.FaultTolerance``: a lost worker costs one step, not the job.

Given to a strategy (``MultiWorkerMirroredStrategy(fault_tolerance=...)``), it makes every
training step a torchft step (``collectives/fault_tolerant_group.py``): the step's quorum
of live workers is made when its first global batch is read (or at ``strategy.run``), the
batch is cut over those workers (``fault_tolerant_input.py``), and the optimizer step is
applied only when torchft commits the step. A worker that dies, is stopped past ``timeout``
or is preempted (SIGTERM: it leaves at the next step boundary) costs the step in flight at
most: no worker applies it, and the next step runs with the workers left, with
``num_replicas_in_sync`` following them. A replacement (the launcher restarts the lost worker
alone) joins at a step boundary and gets, from a live worker over the authenticated process
group, the parameters and buffers, the optimizers' and schedulers' states, the committed-step
count, the random state, where every distributed dataset is, and the epoch of the loop.

``FaultTolerantTraining`` is the strategy's side of it (one per strategy); ``FaultTolerance``
is the user's: the settings, ``epochs()`` (the epoch loop a joining worker can enter in the
middle) and ``committed_step``.

>>> ft = FaultTolerance(min_workers=2, timeout=20)
>>> ft.min_workers, ft.timeout
(2, 20.0)
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any, Protocol

from torch_distribute.collectives.fault_tolerant_group import (
    ENV_JOINED_FILE,
    ENV_MIN_WORKERS,
    LEFT_FOR_PREEMPTION,
    FaultTolerantGroup,
    lighthouse_address,
)
from torch_distribute.collectives.job_secret import required_secret
from torch_distribute.errors import FaultToleranceError, InvalidArgumentError
from torch_distribute.log import get_logger
from torch_distribute.strategies.committed_steps import CommittedStepLog
from torch_distribute.strategies.fault_tolerant_input import LiveSplitSource
from torch_distribute.strategies.random_state import capture_rng, restore_rng

__all__ = ["ENV_LOG_DIR", "FaultTolerance", "FaultTolerantTraining", "RecoverableState"]

#: Where the committed-step log goes when ``FaultTolerance(log_dir=...)`` is not given.
ENV_LOG_DIR = "TD_FT_LOG_DIR"

_log = get_logger("fault_tolerance")


class RecoverableState(Protocol):
    """What a strategy hands a joining worker: its captured state, as plain values."""

    def recovery_state(self) -> dict[str, Any]: ...

    def load_recovery_state(self, state: dict[str, Any]) -> None: ...


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise InvalidArgumentError(f"FaultTolerance({name}=...) must be a positive number of seconds, got {value!r}.")
    return float(value)


class FaultTolerance:
    """Per-step fault tolerance for a multi-worker strategy (TensorFlow-style opt-in).

    - ``min_workers``: the fewest live workers a step may run with. Fewer, and the workers
      wait (up to ``quorum_timeout`` seconds) for replacements, then raise
      ``NotEnoughWorkersError``. Default: the launcher's ``--min-workers``.
    - ``timeout``: seconds a collective waits for a member before counting it lost (a worker
      stopped longer than this is lost; it rejoins if it is continued).
    - ``lighthouse``: torchft's quorum server, ``http://host:port``. Default:
      ``TD_FT_LIGHTHOUSE``, which ``torch-distribute launch --min-workers`` sets.
    - ``log_dir``: where every worker appends the steps it commits (``committed_steps.py``);
      default ``TD_FT_LOG_DIR``, else no log.

    The training loop: iterate the epochs with ``epochs()`` so that a worker joining in
    epoch 3 starts its loop at epoch 3 (the batches inside an epoch resume by themselves)::

        ft = td.experimental.FaultTolerance(min_workers=2)
        strategy = td.MultiWorkerMirroredStrategy(fault_tolerance=ft)
        ...
        for epoch in ft.epochs(EPOCHS):
            for batch in dist_dataset:
                strategy.run(train_step, args=(batch,))

    >>> FaultTolerance(min_workers=0)
    Traceback (most recent call last):
    ...
    torch_distribute.errors.InvalidArgumentError: FaultTolerance(min_workers=0): give at least 1 (the fewest live workers a step may run with).
    """

    def __init__(self, min_workers: int | None = None, *, timeout: float = 30.0, quorum_timeout: float = 300.0,
                 lighthouse: str | None = None, log_dir: str | os.PathLike[str] | None = None) -> None:
        if min_workers is not None and (isinstance(min_workers, bool) or not isinstance(min_workers, int) or min_workers < 1):
            raise InvalidArgumentError(
                f"FaultTolerance(min_workers={min_workers!r}): give at least 1 (the fewest live workers a "
                "step may run with).")
        self._min_workers = min_workers
        self.timeout = _positive("timeout", timeout)
        self.quorum_timeout = _positive("quorum_timeout", quorum_timeout)
        self.lighthouse = lighthouse
        self.log_dir = os.fspath(log_dir) if log_dir is not None else None
        self._training: FaultTolerantTraining | None = None

    @property
    def min_workers(self) -> int | None:
        """The fewest live workers a step may run with (None: the launcher's)."""
        return self._min_workers

    def resolved_min_workers(self, num_workers: int) -> int:
        """``min_workers``, checked against the launcher's ``TD_FT_MIN_WORKERS`` and the job's
        ``num_workers``."""
        launched = os.environ.get(ENV_MIN_WORKERS, "").strip()
        launched_value = int(launched) if launched.isdigit() else None
        value = self._min_workers if self._min_workers is not None else launched_value
        if value is None:
            raise FaultToleranceError(
                "FaultTolerance() has no min_workers and the launcher gave none: pass "
                "FaultTolerance(min_workers=N), or start the job with torch-distribute launch --min-workers N.")
        if launched_value is not None and launched_value != value:
            raise FaultToleranceError(
                f"FaultTolerance(min_workers={value}) but the job's lighthouse was started with "
                f"--min-workers {launched_value}: give both the same number (or leave min_workers out).")
        if value > num_workers:
            raise FaultToleranceError(
                f"FaultTolerance(min_workers={value}) is more than the job's {num_workers} workers.")
        return value

    # -- bound to a strategy ------------------------------------------------------------
    def attach(self, training: FaultTolerantTraining) -> None:
        """Called by the strategy that runs with these settings (once)."""
        if self._training is not None:
            raise InvalidArgumentError(
                "This FaultTolerance already belongs to a strategy: make one per strategy.")
        self._training = training

    def _bound(self) -> FaultTolerantTraining:
        if self._training is None:
            raise FaultToleranceError(
                "This FaultTolerance is not attached to a strategy yet: pass it to "
                "td.MultiWorkerMirroredStrategy(fault_tolerance=...) first.")
        return self._training

    @property
    def committed_step(self) -> int:
        """Training steps the job has committed (a joining worker's count is the job's)."""
        return self._bound().group.committed_step

    def track(self, obj: Any) -> Any:
        """Send ``obj``'s state (its ``state_dict``/``load_state_dict``: a ``GradScaler``, an
        EMA of the weights, a counter of your own) to a worker that joins, as the strategy
        sends the modules, optimizers and schedulers made in its scope. Call it on every
        worker, in the same order, before the first step. Returns ``obj``."""
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(obj, method, None)):
                raise InvalidArgumentError(f"FaultTolerance.track needs an object with {method}(); "
                                           f"{type(obj).__name__} has none.")
        training = self._bound()
        training.register_state(f"tracked#{training.tracked}", obj.state_dict, obj.load_state_dict)
        training.tracked += 1
        return obj

    def epochs(self, num_epochs: int, initial_epoch: int = 0) -> Iterator[int]:
        """The epoch numbers from where the job is (``initial_epoch`` at its start) to
        ``num_epochs``: a worker that joins a running job starts its loop at the job's epoch.
        """
        return self._bound().epochs(num_epochs, initial_epoch)


class FaultTolerantTraining:
    """A strategy's fault-tolerant steps: the group, what a joining worker receives, the
    datasets' positions, the committed-step log and the preemption signal.

    ``state``: the strategy's captured state (``RecoverableState``). ``on_membership(world_size,
    rank)``: called after every quorum; ``on_dropped()``: when a step closes without a commit
    after a failure (the strategy puts back what the step changed).
    """

    def __init__(self, options: FaultTolerance, *, slot: int, num_slots: int, host: str, verify: bool,
                 what: str, state: RecoverableState, on_membership: Callable[[int, int], None],
                 on_dropped: Callable[[], None]) -> None:
        self.options = options
        self.slot = slot
        self.num_slots = num_slots
        self.min_workers = options.resolved_min_workers(num_slots)
        self._state = state
        self._on_membership = on_membership
        self._on_dropped = on_dropped
        self._sources: dict[str, weakref.ref[LiveSplitSource]] = {}
        self._unnamed_sources = 0
        self._next_key: str | None = None
        self._pending_positions: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
        self._extra: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self.tracked = 0  # objects registered by FaultTolerance.track
        self._pending_extra: dict[str, Any] = {}
        self._reads: list[tuple[str, int, int]] = []
        self._commits_in_step = 0
        self.loop_epoch = 0
        self._loop_used = False  # ft.epochs was used (by this worker, or by its source when it joined)
        self._in_loop = False  # inside ft.epochs now
        self._joined_in_loop: int | None = None  # the epoch a heal brought, from a source inside its loop
        self._joined: dict[str, Any] | None = None  # what a heal brought, checked after the quorum
        # Whether a heal in the middle of an epoch can resume this worker's batches there:
        # a custom loop's datasets can be iterated again; fit's epoch data cannot (fit says so).
        self.resumes_inside_epoch = True
        self._rejoin = False  # healed inside its loop where it cannot go on: leave, to join anew
        self._preempted = False
        self._in_quorum = False
        self._announced_join = False
        log_dir = options.log_dir or os.environ.get(ENV_LOG_DIR) or None
        self._log = CommittedStepLog(log_dir, slot) if log_dir else None
        self.group = FaultTolerantGroup(
            slot=slot, host=host, lighthouse=lighthouse_address(options.lighthouse), min_workers=self.min_workers,
            timeout=options.timeout, quorum_timeout=options.quorum_timeout,
            secret=required_secret(host, f"{what} (fault-tolerant)"), verify=verify,
            state_dict=self._state_dict, load_state_dict=self._load_state_dict)
        options.attach(self)
        self._previous_sigterm: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        atexit.register(self.close)

    # -- steps ---------------------------------------------------------------------------
    def begin_step(self, reading: bool = True) -> tuple[int, int]:
        """This step's (world_size, rank), the quorum made where a new step starts.

        A step starts at the first read of its global batch (``reading``; also at
        ``ft.epochs``) or at ``strategy.run`` when nothing was read since the last step
        closed. It closes at its optimizer step (committed or dropped), or at the end of a
        ``run`` when a collective failed. So a step that failed while its batch was read
        still runs on its old quorum (its collectives return at once): every worker makes
        its next quorum at the same point of the program.
        """
        group = self.group
        if not group.step_open or (reading and group.step_failed):
            # Only where a new step starts: a worker asked to stop between its step's read and
            # its run finishes that step, so the others' collectives are not left waiting.
            if self._preempted:
                self._leave()
            self._in_quorum = True
            try:
                group.begin_step()
            finally:
                self._in_quorum = False
            if self._rejoin:
                self._leave("it was behind the job by more than it can resume inside its loop (continued after "
                            "a stop?): it leaves, and its replacement joins at the start of its loop")
            if not self._announced_join:
                self._announce_join()
            self._reads = []
            self._commits_in_step = 0
            self._on_membership(group.world_size, group.rank)
            if self._joined is not None:
                self._check_joined()
        return group.world_size, group.rank

    def end_run(self) -> None:
        """After ``strategy.run``: a step whose collectives failed closes here, and what it
        left (accumulated gradients, moved statistics) is dropped (``on_dropped``)."""
        if self.group.step_open and self.group.step_failed:
            self.group.close_step()
            self._on_dropped()

    def commit(self) -> bool:
        """torchft's verdict on this step; logged when committed."""
        self._commits_in_step += 1
        if self._commits_in_step > 1:
            raise FaultToleranceError(
                "A second optimizer step in one fault-tolerant step: under FaultTolerance each training step "
                "(from one quorum to the next) makes one optimizer step, which torchft commits or drops as a "
                "whole. Step several optimizers (a GAN's) in separate strategy.run calls.")
        group = self.group
        committed = group.should_commit()
        if committed and self._log is not None:
            self._log.write(step=group.committed_step, quorum=group.quorum_id, workers=group.participants,
                            reads=self._reads)
        return committed

    @property
    def step_failed(self) -> bool:
        return self.group.step_failed

    # -- datasets ------------------------------------------------------------------------
    def live_source(self, dataset: Iterable[Any]) -> LiveSplitSource:
        """``dataset`` as a source cut by every step's workers. Its key, in the log and in a
        joining worker's positions: the one ``dataset_key`` gives, else ``#k`` for the
        ``k``-th unnamed one made."""
        key = self._next_key
        if key is None:
            key = f"#{self._unnamed_sources}"
            self._unnamed_sources += 1

        def on_read(passes: int, batch: int) -> None:
            self._reads.append((key, passes, batch))

        def begin() -> tuple[int, int]:
            return self.begin_step()

        source = LiveSplitSource(dataset, begin, on_read)
        self._sources[key] = weakref.ref(source)
        pending = self._pending_positions.pop(key, None)
        if pending is not None:
            source.resume_at(*pending)
        return source

    @contextlib.contextmanager
    def dataset_key(self, key: str) -> Iterator[None]:
        """Distributed datasets made meanwhile are known by ``key`` (``fit``: ``fit/train/3``),
        whatever the order in which a worker makes them."""
        previous, self._next_key = self._next_key, key
        try:
            yield
        finally:
            self._next_key = previous

    def register_state(self, name: str, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]) -> None:
        """More state a joining worker receives (``fit`` registers its own); loaded at once
        if it arrived before being registered."""
        self._extra[name] = (state_dict, load_state_dict)
        if name in self._pending_extra:
            load_state_dict(self._pending_extra.pop(name))

    def unregister_state(self, name: str) -> None:
        self._extra.pop(name, None)

    # -- the loop ------------------------------------------------------------------------
    def epochs(self, num_epochs: int, initial_epoch: int = 0) -> Iterator[int]:
        """``FaultTolerance.epochs``: from the job's epoch (``initial_epoch`` at its start)."""
        self._loop_used = True
        self._joined_in_loop = None
        self.begin_step()  # a joining worker learns the job's epoch here
        joined, self._joined_in_loop = self._joined_in_loop, None
        epoch = joined if joined is not None else initial_epoch
        self._in_loop = True
        try:
            while epoch < num_epochs:
                self.loop_epoch = epoch
                yield epoch
                epoch = self.loop_epoch + 1  # a heal inside the epoch may have moved it on
            self.loop_epoch = epoch
        finally:
            self._in_loop = False

    # -- what a joining worker receives -------------------------------------------------
    def _state_dict(self) -> dict[str, Any]:
        sources = {key: ref() for key, ref in self._sources.items()}
        return {
            "strategy": self._state.recovery_state(),
            "rng": capture_rng([]),
            "sources": {key: source.position() for key, source in sources.items() if source is not None},
            "loop": {"used": self._loop_used, "inside": self._in_loop, "epoch": self.loop_epoch},
            "extra": {name: state_dict() for name, (state_dict, _) in self._extra.items()},
        }

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        self._state.load_recovery_state(state["strategy"])
        restore_rng(state["rng"], [])
        for key, position in state["sources"].items():
            ref = self._sources.get(key)
            source = ref() if ref is not None else None
            if source is not None:
                source.resume_at(position, state["rng"])
            else:
                self._pending_positions[key] = (position, state["rng"])
        for name, value in state["extra"].items():
            if name in self._extra:
                self._extra[name][1](value)
            else:
                self._pending_extra[name] = value
        if state["loop"]["inside"]:
            epoch = int(state["loop"]["epoch"])
            self._rejoin = self._in_loop and (epoch != self.loop_epoch or not self.resumes_inside_epoch)
            self.loop_epoch = epoch
            self._joined_in_loop = epoch
        self._joined = state

    def _check_joined(self) -> None:
        """A worker that joined a running job must be able to go on where the job is."""
        joined, self._joined = self._joined, None
        assert joined is not None
        if self.group.committed_step == 0:
            return  # the start of the job: every worker takes the first one's state
        passes = [p["passes"] for p in joined["sources"].values()]
        if not self._loop_used and (joined["loop"]["used"] or any(n > 1 for n in passes)):
            raise FaultToleranceError(
                f"Worker {self.slot} joined the job at committed step {self.group.committed_step}, in epoch "
                f"{joined['loop']['epoch']}, but its training loop starts at the beginning: write the epoch "
                "loop as `for epoch in ft.epochs(EPOCHS):` (ft: the strategy's td.experimental.FaultTolerance) "
                "so that a worker that joins enters it where the job is.")
        _log.info("worker %d joined at committed step %d (epoch %d)", self.slot, self.group.committed_step,
                  self.loop_epoch)

    def _announce_join(self) -> None:
        """Tell the launcher this worker is part of the job now (``TD_FT_JOINED_FILE``)."""
        self._announced_join = True
        path = os.environ.get(ENV_JOINED_FILE)
        if path:
            with open(path, "w", encoding="utf-8") as file:
                file.write(f"{self.group.committed_step}\n")

    # -- leaving -------------------------------------------------------------------------
    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._preempted = True
        if self._in_quorum:  # waiting for a quorum (for replacements, say): nothing to finish
            self._leave()

    def _leave(self, why: str = "it was asked to stop (SIGTERM)") -> None:
        """Leave the job at a step boundary with status 143: the launcher starts a replacement."""
        _log.warning("worker %d leaves the job at a step boundary, the others go on: %s", self.slot, why)
        self.close()
        raise SystemExit(LEFT_FOR_PREEMPTION)

    def close(self) -> None:
        """Leave the job (at exit, when preempted, or when the program is done with it): the
        SIGTERM handler this made is put back as it was."""
        atexit.unregister(self.close)
        if (self._previous_sigterm is not None and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) == self._on_sigterm):
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        self.group.close()
