"""The strategy a scheduled function sees on a parameter-server worker.

A function scheduled by ``ClusterCoordinator.schedule`` refers to the coordinator's
``ParameterServerStrategy``; on the worker that reference becomes this strategy: one local
replica, run in the calling thread, with the same ``run``/``reduce``/``gather`` semantics as
every other strategy. Parameters and optimizers the function uses are the worker's
stand-ins for the coordinator's (``ps/worker.py``), so nothing is captured here.

>>> import torch
>>> strategy = ParameterServerWorkerStrategy(worker_index=1)
>>> strategy.reduce("mean", strategy.run(lambda: torch.tensor([2.0, 4.0])), axis=0)
tensor(3.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torch_distribute.devices import LogicalDevice
from torch_distribute.replica_context import ReplicaContext
from torch_distribute.strategies.base import Strategy
from torch_distribute.strategies.extended import StrategyExtended
from torch_distribute.strategies.single_replica import call_on_this_thread


class ParameterServerWorkerExtended(StrategyExtended):
    """One CPU replica on a worker task; the worker's index is ``task_index``."""

    def __init__(self, strategy: Strategy, worker_index: int):
        super().__init__(strategy, (LogicalDevice("cpu", 0),))
        self.task_index = worker_index
        self._replica_context = ReplicaContext(strategy, 0)

    @property
    def should_checkpoint(self) -> bool:
        return False  # the coordinator saves; a worker's copy is a cache of the servers'

    @property
    def should_save_summary(self) -> bool:
        return False

    def call_for_each_replica(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return call_on_this_thread(self._replica_context, torch.device("cpu"), fn, args, kwargs)


class ParameterServerWorkerStrategy(Strategy):
    """``ParameterServerStrategy`` as seen inside a scheduled function on a worker."""

    def __init__(self, worker_index: int):
        super().__init__(ParameterServerWorkerExtended(self, worker_index))
        self._worker_index = worker_index

    def __repr__(self) -> str:
        return f"ParameterServerWorkerStrategy(worker_index={self._worker_index})"
