"""Exception classes raised by torch-distribute.

Every error the library raises on bad input is one of these, so callers can catch
``td.DistributeError`` and the message always says what to change.
"""

from __future__ import annotations


class DistributeError(Exception):
    """Base class of every torch-distribute error."""


class InvalidDeviceError(DistributeError, ValueError):
    """A device string that cannot be parsed or is not available."""


class UnsupportedDtypeError(InvalidDeviceError):
    """A compute dtype (``float16``, ``bfloat16``) the device cannot autocast to."""


class InvalidReduceOpError(DistributeError, ValueError):
    """A reduce op other than ``SUM`` or ``MEAN``."""


class InvalidAxisError(DistributeError, ValueError):
    """An axis out of range for the value it reduces or gathers."""


class InvalidArgumentError(DistributeError, ValueError):
    """An argument of the wrong kind (``args`` not a tuple, bad batch size, ...)."""


class InputSignatureError(InvalidArgumentError, TypeError):
    """Arguments that do not match a ``td.function``'s ``input_signature`` (a ``TypeError``, as
    TensorFlow raises for a ``tf.function``)."""


class ContextError(DistributeError, RuntimeError):
    """A call made in the wrong context (cross-replica vs replica, or the wrong scope)."""


class ReplicaMismatchError(DistributeError, RuntimeError):
    """Replicas disagreed: different nests returned, or a different number of merge calls."""


class UnmirroredStateError(DistributeError, RuntimeError):
    """A parameter not created in ``strategy.scope()`` was used by a multi-replica strategy."""


class LossScalingError(DistributeError, ValueError):
    """A loss averaged over one replica's batch inside ``strategy.run`` with several replicas:
    gradients are summed across replicas, so use ``td.compute_average_loss``."""


class NonFiniteError(DistributeError, FloatingPointError):
    """A gradient that is inf or NaN, with ``td.config.set_nonfinite_check("raise")``."""


class DatasetError(DistributeError, ValueError):
    """A dataset that cannot be distributed (unbatched, empty, mixed batch sizes)."""


class CheckpointError(DistributeError, OSError):
    """A checkpoint that is missing, corrupt or does not match the objects it restores into."""


class WorkerUnavailableError(DistributeError, RuntimeError):
    """A worker process died, hung or could not be reached: restart the job and restore.

    ``restart_can_help`` says whether restarting can: False when the worker left because
    its program raised (``PeerProgramError``).
    """

    restart_can_help = True


class PeerProgramError(WorkerUnavailableError):
    """Another worker's program raised an exception and that worker exited: a bug to fix (its
    traceback is in its output), which a restart runs into again. ``errors`` maps each such
    worker's index to its error."""

    restart_can_help = False

    def __init__(self, message: str, errors: dict[int, str] | None = None):
        super().__init__(message)
        self.errors = dict(errors or {})


class NotEnoughWorkersError(WorkerUnavailableError):
    """A fault-tolerant job (``td.experimental.FaultTolerance``) had fewer live workers than
    its ``min_workers`` for longer than its ``quorum_timeout``: start replacements sooner, or
    lower ``min_workers``."""


class FaultToleranceError(DistributeError, RuntimeError):
    """Per-step fault tolerance asked for where it cannot work: torchft is not installed, a
    setting disagrees with the launcher's, or a worker that joined a running job has a
    training loop that cannot resume where the job is (the message says what to change)."""


class ClusterConfigError(DistributeError, ValueError):
    """A cluster description (``TF_CONFIG``, torchrun or SLURM environment) that is invalid."""


class ParameterServerUnavailableError(WorkerUnavailableError):
    """A parameter server died or stopped answering: its variables are lost. Restart every
    task and restore the coordinator's last checkpoint."""


class ClosureCancelledError(DistributeError, RuntimeError):
    """A scheduled function was cancelled (an earlier one failed) before it ran."""


class OutOfRangeError(DistributeError, RuntimeError):
    """An iterator ran out of data: ``iterator.get_next()`` past the end of a distributed
    dataset (TensorFlow's ``tf.errors.OutOfRangeError``; ``next(iterator)`` raises
    ``StopIteration``), or a per-worker iterator inside a scheduled function."""


class JobAuthenticationError(DistributeError, PermissionError):
    """A process did not prove the job secret (``TD_JOB_SECRET``): it is refused, not joined.
    Give every process of the job the same secret (docs/security.md)."""


class LayoutError(DistributeError, ValueError):
    """A device mesh or layout that cannot work for the model: an axis that does not divide a
    dimension, a pattern that matches nothing, a module tensor parallelism cannot split, or
    workers that disagree on the layout."""
class KerasIntegrationError(DistributeError, RuntimeError):
    """A Keras 3 model (``KERAS_BACKEND=torch``) in a strategy's scope that this library cannot
    train as one device would; the message says what to change. Its subclasses say why."""


class KerasBackendError(KerasIntegrationError):
    """Keras was imported with a backend other than ``torch`` (set ``KERAS_BACKEND=torch``
    before the first ``import keras``), or is a version outside the range this library tests."""


class KerasUnsupportedError(KerasIntegrationError):
    """A strategy or a Keras setting this library does not serve for Keras 3 models (for
    example ``FullyShardedStrategy``, ``jit_compile=True`` with several replicas, or Keras' own
    ``keras.distribution`` combined with a strategy's scope)."""
