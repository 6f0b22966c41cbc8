"""Where a fault-tolerant strategy's inputs and addresses come from.

``fault_tolerant_dataset``: ``experimental_distribute_dataset`` under fault tolerance. Every
global batch is cut over the live workers of its step (``fault_tolerant_input.py``), as the
DATA policy cuts it over every worker: the only policy under which a step with any set of
workers trains on exactly the rows of its global batch, each once. FILE and OFF (each worker
reads its own files or its own share) and a read-ahead buffer (which would cut batches before
their step's workers are known) are refused with what to do instead.

``store_host``: the address the other workers reach this one at.

>>> import torch
>>> store_host("http://127.0.0.1:29510")
'127.0.0.1'
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import urllib.parse
from collections.abc import Iterable
from typing import Any

import torch

from torch_distribute.collectives.fault_tolerant_group import ENV_LIGHTHOUSE
from torch_distribute.errors import FaultToleranceError
from torch_distribute.input import AutoShardPolicy, DistributedDataset, InputOptions
from torch_distribute.input.dataset_options import options_of, unwrapped
from torch_distribute.input.distributed_dataset import SyncStep
from torch_distribute.input.sharding_sampler import refuse_sharding_sampler
from torch_distribute.strategies.fault_tolerant import FaultTolerantTraining

__all__ = ["ENV_HOST", "fault_tolerant_dataset", "store_host"]

#: This worker's address for the others, where it cannot be found (several interfaces).
ENV_HOST = "TD_FT_HOST"


def fault_tolerant_dataset(training: FaultTolerantTraining, dataset: Iterable[Any], devices: list[torch.device],
                           options: InputOptions | None, sync_step: SyncStep) -> DistributedDataset:
    """``dataset`` (global batches) as a distributed dataset cut by every step's live workers."""
    options = options or InputOptions()
    requested = options.auto_shard_policy or options_of(dataset).experimental_distribute.auto_shard_policy
    if requested in (AutoShardPolicy.FILE, AutoShardPolicy.OFF):
        raise FaultToleranceError(
            f"AutoShardPolicy.{requested.name} under FaultTolerance: a lost worker's own files or share "
            "would not be read while it is gone. Fault-tolerant training cuts every global batch over the "
            "workers of its step (AutoShardPolicy.DATA, the default here): give every worker the same "
            "global batches.")
    if options.experimental_per_replica_buffer_size:
        raise FaultToleranceError(
            "InputOptions(experimental_per_replica_buffer_size=...) under FaultTolerance: a batch read "
            "ahead would be cut before its step's workers are known. Leave it out (0 here).")
    refuse_sharding_sampler(unwrapped(dataset), requested, training.num_slots, training.slot)
    live_options = dataclasses.replace(options, auto_shard_policy=AutoShardPolicy.OFF,
                                       experimental_per_replica_buffer_size=0)
    return DistributedDataset(training.live_source(dataset), devices, num_workers=1, worker_index=0,
                              options=live_options, sync_step=sync_step)


def store_host(lighthouse: str | None) -> str:
    """Where this worker's store and torchft's manager listen: ``TD_FT_HOST``, else loopback
    for a job on one machine (a loopback lighthouse), else the address this machine reaches
    the lighthouse from."""
    given = os.environ.get(ENV_HOST, "").strip()
    if given:
        return given
    address = lighthouse or os.environ.get(ENV_LIGHTHOUSE) or os.environ.get("TORCHFT_LIGHTHOUSE") or ""
    host = urllib.parse.urlsplit(address if "://" in address else f"http://{address}").hostname or "127.0.0.1"
    try:
        resolved = socket.gethostbyname(host)
    except OSError:
        resolved = host
    try:
        if ipaddress.ip_address(resolved).is_loopback:
            return "127.0.0.1"
    except ValueError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((resolved, 9))  # no packet is sent: only the route is looked up
            return str(probe.getsockname()[0])
    except OSError as error:
        raise FaultToleranceError(
            f"Cannot tell which address of this machine the other workers reach (towards {host}: {error}); "
            f"set {ENV_HOST} to it.") from error
