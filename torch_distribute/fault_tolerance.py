"""``BackupAndRestore``: resume a custom training loop where it stopped.

Wrap the loops, and the training state (your checkpoint: models, optimizers, metrics; plus
epoch, step, the position in the data and every RNG state) is backed up every ``save_freq``
steps (or every epoch), atomically and with a checksum. The save is collective: the chief
writes, and every worker goes on only once the backup is complete. When the program starts
again with a backup present, every worker restores it (an older one, with a warning, if the
newest is damaged) and the loops continue at the same epoch and step, on the same data, with
the same random numbers: a run killed and restarted ends with the same parameters as one
that was never interrupted.

A preemption signal (SIGTERM) to any worker makes every worker save at the same step, then
exit, as TensorFlow's ``PreemptionCheckpointHandler`` does: the preempted worker publishes
"the step after this one" in the job's c10d store, and each worker checks the key after
every step.

>>> import tempfile, torch, torch_distribute as td
>>> model = torch.nn.Linear(2, 1)
>>> backup = td.BackupAndRestore(td.Checkpoint(model=model), tempfile.mkdtemp(), save_freq=2)
>>> for epoch in backup.epochs(2):
...     for batch in backup.steps([torch.ones(1, 2)] * 3):
...         loss = model(batch).sum()
>>> backup.global_step
6
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch

from torch_distribute.checkpoint import (
    INDEX_FILENAME,
    Checkpoint,
    CheckpointManager,
    owning_strategy,
)
from torch_distribute.checkpoint.collective import num_workers
from torch_distribute.checkpoint.file_io import remove_checkpoint
from torch_distribute.errors import InvalidArgumentError
from torch_distribute.strategies.random_state import capture_rng, find_generators, restore_rng

if TYPE_CHECKING:
    from torch_distribute.strategies import Strategy

_PREEMPTION_KEY = "td/preemption_step"
PREEMPTION_EXIT_CODE = 143  # 128 + SIGTERM, what a process killed by SIGTERM reports


class _Position:
    """Epoch, step and RNG states; saved inside the backup checkpoint.

    RNG states are per worker (each has its own dropout stream): the lists hold one state
    per worker, gathered when the chief saves.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.step_in_epoch = 0
        self.global_step = 0
        self.epoch_start_rng: list[dict[str, Any]] | None = None
        self.current_rng: list[dict[str, Any]] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "global_step": self.global_step,
            "epoch_start_rng": self.epoch_start_rng,
            "current_rng": self.current_rng,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.step_in_epoch = int(state["step_in_epoch"])
        self.global_step = int(state["global_step"])
        self.epoch_start_rng = state["epoch_start_rng"]
        self.current_rng = state["current_rng"]


class BackupAndRestore:
    """Back up training state every ``save_freq`` steps and resume from it after a restart.

    ``checkpoint_or_manager``: a ``td.Checkpoint`` of your models, optimizers, metrics, LR
    schedulers (or a ``CheckpointManager``, whose checkpoint is used). ``save_freq``:
    ``"epoch"`` or a number of steps. ``generators``: extra ``torch.Generator`` objects whose
    state decides the data (those of a ``DataLoader`` given to ``steps`` are found by
    themselves). ``delete_checkpoint``: remove the backup when training finishes.
    """

    def __init__(
        self,
        checkpoint_or_manager: Checkpoint | CheckpointManager,
        backup_dir: str | os.PathLike[str],
        save_freq: int | str = "epoch",
        delete_checkpoint: bool = True,
        handle_preemption: bool = True,
        generators: Iterable[torch.Generator] = (),
        exit_fn: Callable[[], None] | None = None,
        strategy: Strategy | None = None,
    ):
        checkpoint = (
            checkpoint_or_manager.checkpoint
            if isinstance(checkpoint_or_manager, CheckpointManager)
            else checkpoint_or_manager
        )
        if not isinstance(checkpoint, Checkpoint):
            raise InvalidArgumentError(
                f"BackupAndRestore needs a td.Checkpoint or td.CheckpointManager, got "
                f"{type(checkpoint_or_manager).__name__}."
            )
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1):
            raise InvalidArgumentError(f"save_freq must be 'epoch' or a positive int, got {save_freq!r}.")
        self._strategy = strategy or owning_strategy([checkpoint])
        self._save_freq = save_freq
        self._delete_checkpoint = delete_checkpoint
        self._generators = list(generators)
        self._exit_fn = exit_fn or (lambda: sys.exit(PREEMPTION_EXIT_CODE))
        self._position = _Position()
        self._manager = CheckpointManager(
            Checkpoint(training=checkpoint, position=self._position),
            os.fspath(backup_dir), max_to_keep=1, checkpoint_name="backup",
        )
        self._active_generators = list(self._generators)
        self._epoch_start_rng: dict[str, Any] | None = None
        self._preempted_locally = False
        self._published = False
        self._resume_step = 0
        self.restored_from = self._manager.restore_or_initialize()
        if self.restored_from is not None:
            self._resume_step = self._position.step_in_epoch
        if handle_preemption and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    # -- where we are -----------------------------------------------------------------------
    @property
    def initial_epoch(self) -> int:
        return self._position.epoch

    @property
    def global_step(self) -> int:
        return self._position.global_step

    @property
    def step_in_epoch(self) -> int:
        return self._position.step_in_epoch

    # -- the loops ----------------------------------------------------------------------------
    def epochs(self, num_epochs: int, initial_epoch: int = 0) -> Iterator[int]:
        """Epoch numbers from the restored epoch (else ``initial_epoch``) up to ``num_epochs``;
        backs up after each."""
        if self.restored_from is None and self._position.epoch < initial_epoch:
            self._position.epoch = initial_epoch
        for epoch in range(self._position.epoch, num_epochs):
            self._position.epoch = epoch
            yield epoch
            self._position.epoch = epoch + 1
            self._position.step_in_epoch = 0
            if self._save_freq == "epoch":
                self._save()
        self.finish()

    def steps(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """The batches of one epoch, skipping those already trained on before a restart."""
        generators = self._generators + find_generators(iterable)
        self._active_generators = generators
        resuming = self._resume_step
        self._resume_step = 0
        if resuming and self._position.epoch_start_rng is not None:
            restore_rng(self._mine(self._position.epoch_start_rng), generators)
        elif self._position.current_rng is not None and self.restored_from is not None:
            restore_rng(self._mine(self._position.current_rng), generators)
        self._epoch_start_rng = capture_rng(generators)
        iterator = iter(iterable)
        for _ in range(resuming):
            next(iterator)
        if resuming and self._position.current_rng is not None:
            restore_rng(self._mine(self._position.current_rng), generators)
        self.restored_from = None
        for batch in iterator:
            yield batch
            self.step_done()

    def step_done(self) -> None:
        """Count one training step (``steps`` calls it after each batch): back up every
        ``save_freq`` steps and, once a preemption is due on every worker, save and exit."""
        self._position.step_in_epoch += 1
        self._position.global_step += 1
        saved = False
        save_freq = self._save_freq  # an int or "epoch", the only string __init__ accepts
        if isinstance(save_freq, int) and self._position.global_step % save_freq == 0:
            self._save()
            saved = True
        if self._preemption_due():
            if not saved:
                self._save()
            self._exit_fn()

    def finish(self) -> None:
        """Training is over: delete the backup (``delete_checkpoint=True``).

        Under several workers every worker deletes what it sees: its own copy where each
        worker has its own disk, the chief's files on a shared one (deleting twice is harmless).
        """
        extended = self._strategy.extended
        if self._delete_checkpoint and (extended.should_checkpoint or num_workers(extended) > 1):
            for path in self._manager.checkpoints:
                remove_checkpoint(path)
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self._manager.directory, INDEX_FILENAME))

    # -- saving -------------------------------------------------------------------------------
    def _save(self) -> str:
        states = (self._epoch_start_rng, capture_rng(self._active_generators))
        every_worker = self._strategy.extended.all_gather_objects(states, what="backup")
        self._position.epoch_start_rng = [start for start, _ in every_worker]
        self._position.current_rng = [current for _, current in every_worker]
        return self._manager.save()

    def _mine(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        """This worker's saved RNG state (worker 0's when the worker count changed)."""
        extended = self._strategy.extended
        index = extended.worker_index
        return states[index] if len(states) == extended.num_workers_in_sync else states[0]

    # -- preemption ---------------------------------------------------------------------------
    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._preempted_locally = True

    def _preemption_due(self) -> bool:
        store = self._strategy.extended.coordination_store
        step = self._position.global_step
        if store is None:
            return self._preempted_locally
        if self._preempted_locally and not self._published:
            # Publish "the step after this one": every worker can still reach it (none can
            # finish a step without this worker), and none has passed it.
            store.compare_set(_PREEMPTION_KEY, "", str(step + 1))
            self._published = True
        if store.check([_PREEMPTION_KEY]):
            return step >= int(store.get(_PREEMPTION_KEY))
        return False


class TerminationConfig:
    """TensorFlow's ``tf.distribute.experimental.TerminationConfig``: what to do once the
    preemption checkpoint is saved. ``exit_fn``: called then (default: exit with
    ``PREEMPTION_EXIT_CODE``, which the launcher restarts). The preemption signal is SIGTERM;
    ``termination_watcher_fn``, ``grace_period`` and ``save_fn`` are not supported (they raise).
    """

    def __init__(self, termination_watcher_fn: Any = None, exit_fn: Callable[[], None] | None = None,
                 grace_period: Any = None, save_fn: Any = None):
        for name, value in (("termination_watcher_fn", termination_watcher_fn), ("grace_period", grace_period),
                            ("save_fn", save_fn)):
            if value is not None:
                raise InvalidArgumentError(
                    f"TerminationConfig({name}=...) is not supported: the preemption signal is SIGTERM and the "
                    "checkpoint is saved at the next step every worker reaches. Pass exit_fn only.")
        if exit_fn is not None and not callable(exit_fn):
            raise InvalidArgumentError(f"TerminationConfig exit_fn must be callable, got {type(exit_fn).__name__}.")
        self.exit_fn = exit_fn


class PreemptionCheckpointHandler:
    """TensorFlow's ``tf.distribute.experimental.PreemptionCheckpointHandler`` on ``BackupAndRestore``.

    Made, it restores the newest checkpoint in ``checkpoint_dir`` (``total_run_calls`` goes
    on from there). ``run(train_step, *args)`` calls the step; after a SIGTERM to any worker,
    every worker saves at the same step and exits (``termination_config.exit_fn``).
    ``cluster_resolver`` is accepted for TensorFlow's signature: the workers are those of the
    strategy the checkpointed objects belong to.

    >>> import tempfile, torch, torch_distribute as td
    >>> model = torch.nn.Linear(2, 1)
    >>> handler = td.experimental.PreemptionCheckpointHandler(
    ...     None, td.Checkpoint(model=model), tempfile.mkdtemp())
    >>> for _ in range(3):
    ...     loss = handler.run(lambda x: model(x).sum(), torch.ones(1, 2))
    >>> handler.total_run_calls
    3
    """

    def __init__(self, cluster_resolver: Any, checkpoint_or_checkpoint_manager: Checkpoint | CheckpointManager,
                 checkpoint_dir: str | os.PathLike[str] | None = None,
                 termination_config: TerminationConfig | None = None):
        if checkpoint_dir is None:
            if not isinstance(checkpoint_or_checkpoint_manager, CheckpointManager):
                raise InvalidArgumentError(
                    "PreemptionCheckpointHandler needs checkpoint_dir with a td.Checkpoint (or pass a "
                    "td.CheckpointManager, whose directory is used).")
            checkpoint_dir = checkpoint_or_checkpoint_manager.directory
        if termination_config is not None and not isinstance(termination_config, TerminationConfig):
            raise InvalidArgumentError(
                f"termination_config must be a td.experimental.TerminationConfig, got {type(termination_config).__name__}.")
        self.cluster_resolver = cluster_resolver
        self._backup = BackupAndRestore(
            checkpoint_or_checkpoint_manager, checkpoint_dir, save_freq="epoch", delete_checkpoint=False,
            exit_fn=termination_config.exit_fn if termination_config is not None else None)

    @property
    def total_run_calls(self) -> int:
        """The steps ``run`` has run, those before a restart included (restored)."""
        return self._backup.global_step

    def run(self, distributed_train_function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``distributed_train_function(*args, **kwargs)``, then save and exit if a preemption is due."""
        result = distributed_train_function(*args, **kwargs)
        self._backup.step_done()
        return result

    @contextlib.contextmanager
    def watch_preemption_scope(self) -> Iterator[None]:
        """TensorFlow's scope around the loop; the SIGTERM handler is installed at construction."""
        yield
