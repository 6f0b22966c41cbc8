"""A dataset's own options (``tf.data.Options`` and ``dataset.with_options``), as ``td.data``.

A torch iterable has nowhere to keep options, so ``with_options(dataset, options)`` returns
a thin wrapper that yields the same batches and carries them. ``experimental_distribute_dataset``
and ``Model.fit`` read its ``auto_shard_policy``; a policy given in the call's ``InputOptions``
takes precedence.

>>> import torch, torch_distribute as td
>>> options = td.data.Options()
>>> options.experimental_distribute.auto_shard_policy = td.data.AutoShardPolicy.OFF
>>> ds = td.data.with_options([torch.ones(4, 2)], options)
>>> ds.options().experimental_distribute.auto_shard_policy
<AutoShardPolicy.OFF: 'OFF'>
>>> td.data.experimental.AutoShardPolicy is td.data.AutoShardPolicy   # tf.data.experimental's name
True
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from torch_distribute.errors import DatasetError, InvalidArgumentError
from torch_distribute.input.input_context import AutoShardPolicy

__all__ = ["AutoShardPolicy", "DatasetWithOptions", "DistributeOptions", "Options", "experimental", "options_of",
           "resolve_shard_policy", "unwrapped", "with_options"]


@dataclass
class DistributeOptions:
    """``tf.data.experimental.DistributeOptions``: ``auto_shard_policy`` (``None``: not set, AUTO)."""

    auto_shard_policy: AutoShardPolicy | None = None


@dataclass
class Options:
    """``tf.data.Options``: the options a dataset carries (only the distribution ones here).

    >>> Options().experimental_distribute.auto_shard_policy is None
    True
    """

    experimental_distribute: DistributeOptions = field(default_factory=DistributeOptions)

    def merge(self, other: Options) -> Options:
        """These options with the ones set in ``other`` taking precedence (TF's merge)."""
        merged = copy.deepcopy(self)
        policy = other.experimental_distribute.auto_shard_policy
        if policy is not None:
            merged.experimental_distribute.auto_shard_policy = policy
        return merged


#: ``tf.data.experimental``'s names that ports use: ``td.data.experimental.AutoShardPolicy``.
experimental = SimpleNamespace(AutoShardPolicy=AutoShardPolicy, DistributeOptions=DistributeOptions)


def _checked(options: Any) -> Options:
    if not isinstance(options, Options):
        raise InvalidArgumentError(f"with_options takes a td.data.Options, got {type(options).__name__}.")
    policy = options.experimental_distribute.auto_shard_policy
    if policy is not None and not isinstance(policy, AutoShardPolicy):
        raise InvalidArgumentError(
            f"experimental_distribute.auto_shard_policy must be a td.data.AutoShardPolicy or None, got {policy!r}."
        )
    return copy.deepcopy(options)


class DatasetWithOptions:
    """An iterable that yields ``dataset``'s batches and carries ``options()``.

    Other attributes (``len``, ``shard``, a ``DataLoader``'s ``sampler``...) are ``dataset``'s.
    """

    def __init__(self, dataset: Iterable[Any], options: Options):
        self.dataset = dataset
        self._options = options

    def options(self) -> Options:
        """The options of this dataset (a copy)."""
        return copy.deepcopy(self._options)

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.dataset)
        return self if iterator is self.dataset else iterator  # a one-shot iterator stays one

    def __next__(self) -> Any:
        return next(self.dataset)  # type: ignore[call-overload]

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __repr__(self) -> str:
        return f"DatasetWithOptions({self.dataset!r}, {self._options!r})"


def with_options(dataset: Iterable[Any], options: Options) -> DatasetWithOptions:
    """``dataset.with_options(options)``: the same batches, carrying ``options``.

    Options given again are merged, the new ones taking precedence.

    >>> import torch, torch_distribute as td
    >>> opts = td.data.Options()
    >>> opts.experimental_distribute.auto_shard_policy = td.data.AutoShardPolicy.DATA
    >>> loader = td.data.with_options([torch.zeros(8, 3)], opts)
    >>> strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> [tuple(t.shape) for t in next(iter(strategy.experimental_distribute_dataset(loader))).values]
    [(4, 3), (4, 3)]
    """
    options = _checked(options)
    if isinstance(dataset, DatasetWithOptions):
        return DatasetWithOptions(dataset.dataset, dataset.options().merge(options))
    if not hasattr(dataset, "__iter__"):
        raise InvalidArgumentError(f"with_options needs an iterable of batches, got {type(dataset).__name__}.")
    return DatasetWithOptions(dataset, options)


def options_of(dataset: Any) -> Options:
    """The options ``dataset`` carries (``Options()`` when it carries none)."""
    return dataset.options() if isinstance(dataset, DatasetWithOptions) else Options()


def unwrapped(dataset: Any) -> Any:
    """The dataset under any options."""
    return dataset.dataset if isinstance(dataset, DatasetWithOptions) else dataset


def resolve_shard_policy(dataset: Any, requested: AutoShardPolicy | None, num_workers: int) -> AutoShardPolicy:
    """The policy that applies: ``requested`` (the call's) if set, else the dataset's own, else AUTO.

    With one worker nothing is sharded (OFF). AUTO is FILE when the dataset can shard itself
    (a method ``shard(num_shards, index)``), else DATA.
    """
    policy = requested if requested is not None else options_of(dataset).experimental_distribute.auto_shard_policy
    if policy is None:
        policy = AutoShardPolicy.AUTO
    if num_workers == 1:
        return AutoShardPolicy.OFF
    can_shard = callable(getattr(dataset, "shard", None))
    if policy is AutoShardPolicy.AUTO:
        return AutoShardPolicy.FILE if can_shard else AutoShardPolicy.DATA
    if policy is AutoShardPolicy.FILE and not can_shard:
        raise DatasetError(
            f"AutoShardPolicy.FILE needs a dataset that can shard its files, with a method "
            f"shard(num_shards, index); {type(unwrapped(dataset)).__name__} has none. Use "
            "AutoShardPolicy.DATA (every worker reads everything and keeps its rows) or "
            "shard it yourself and use AutoShardPolicy.OFF."
        )
    return policy
