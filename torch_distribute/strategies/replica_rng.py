"""Each CPU replica thread of a ``MirroredStrategy`` draws from a random generator of its own.

Torch's default CPU generator is one per process, so replica threads drawing from it at the
same time would get their numbers in whatever order the threads happen to run: the same
seeded program would train differently from one run to the next. Torch has no thread-local
default generator, and most sampling functions (``dropout`` among them) take no
``generator=`` argument. So inside a replica, ``ReplicaRandomMode`` runs every sampling
function (``torch.rand*``, ``bernoulli``, ``dropout``, ``Tensor.uniform_``, ``nn.init``…)
under one process-wide lock with the default generator's state swapped for the replica's
own, then swapped back. Only the sampling calls are serialized; the rest of the step still
runs concurrently.

Seeding rule: in every ``strategy.run`` that samples, the first sampling call of any replica
draws one 64-bit ``base`` from torch's default CPU generator (so from ``torch.manual_seed``),
and replica ``r`` (its ``replica_id_in_sync_group``) samples from a generator seeded with
``splitmix64(base + r)``. Hence the same seed gives the same run; replicas get different
numbers (as TensorFlow's per-replica generators do); and since the per-replica streams
derive from the default generator, ``BackupAndRestore``, which saves and restores that
generator, resumes them exactly.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["ReplicaRandomMode", "RunSeed", "in_replica_stream", "replica_seed"]

_MASK = (1 << 64) - 1
_LOCK = threading.Lock()
_entered = threading.local()  # how many ReplicaRandomModes this thread is in


def in_replica_stream() -> bool:
    """Whether this thread's sampling already draws from a replica's own generator (inside a
    CPU replica thread's ``ReplicaRandomMode``): a layer above that gives replicas streams of
    their own (the Keras 3 integration) leaves such a replica alone.

    >>> in_replica_stream()
    False
    """
    return getattr(_entered, "depth", 0) > 0


_TORCH = ("rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "bernoulli",
          "multinomial", "normal", "poisson", "binomial", "dropout", "dropout_", "alpha_dropout", "alpha_dropout_",
          "feature_dropout", "feature_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_", "native_dropout",
          "rrelu", "rrelu_", "lstm", "gru", "rnn_tanh", "rnn_relu", "_standard_gamma", "_sample_dirichlet")
_TENSOR = ("bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_", "geometric_", "cauchy_",
           "log_normal_", "multinomial")
_FUNCTIONAL = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
               "rrelu", "rrelu_", "gumbel_softmax")
_INIT = ("uniform_", "normal_", "trunc_normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
         "kaiming_normal_", "orthogonal_", "sparse_")

_SAMPLING = frozenset(
    [getattr(torch, n) for n in _TORCH if hasattr(torch, n)]
    + [getattr(torch.Tensor, n) for n in _TENSOR]
    + [getattr(F, n) for n in _FUNCTIONAL]
    + [getattr(torch.nn.init, n) for n in _INIT]
)


def replica_seed(base: int, replica_id: int) -> int:
    """The seed of replica ``replica_id``'s generator in a run whose ``base`` is given (splitmix64).

    >>> replica_seed(7, 0) != replica_seed(7, 1)
    True
    """
    z = (base + 0x9E3779B97F4A7C15 * (replica_id + 1)) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class RunSeed:
    """One run's ``base``, drawn from the default generator when a replica first samples."""

    def __init__(self) -> None:
        self._base: int | None = None

    def base(self) -> int:
        """Called with the lock held."""
        if self._base is None:
            self._base = int(torch.empty((), dtype=torch.int64).random_(generator=torch.default_generator)) & _MASK
        return self._base


class ReplicaRandomMode(TorchFunctionMode):
    """Inside one CPU replica thread: sampling functions draw from this replica's generator.

    >>> import torch, torch_distribute as td
    >>> strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> _ = torch.manual_seed(0)
    >>> masks = strategy.experimental_local_results(strategy.run(lambda: torch.rand(4)))
    >>> bool(torch.equal(masks[0], masks[1]))
    False
    """

    def __init__(self, run_seed: RunSeed, replica_id: int):
        super().__init__()
        self._run_seed = run_seed
        self._replica_id = replica_id
        self._generator: torch.Generator | None = None

    def __enter__(self) -> ReplicaRandomMode:
        _entered.depth = getattr(_entered, "depth", 0) + 1
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _entered.depth -= 1
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in _SAMPLING and not _samples_attention(func, args, kwargs):
            return func(*args, **kwargs)
        default = torch.default_generator
        with _LOCK:
            if self._generator is None:
                seed = replica_seed(self._run_seed.base(), self._replica_id)
                self._generator = torch.Generator().manual_seed(seed)
            saved = default.get_state()
            default.set_state(self._generator.get_state())
            try:
                return func(*args, **kwargs)
            finally:
                self._generator.set_state(default.get_state())
                default.set_state(saved)


def _samples_attention(func: Any, args: tuple, kwargs: dict) -> bool:
    if func is not F.scaled_dot_product_attention:
        return False
    dropout_p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
    return bool(dropout_p)
