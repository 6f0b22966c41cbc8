"""``td.config``: TensorFlow's ``tf.config`` device listing and logical devices.

Several replicas on one GPU, as TensorFlow's logical GPUs give them: split the physical GPU,
then every strategy made afterwards sees the logical GPUs ``cuda:0``, ``cuda:1``, ... (each
replica on its own CUDA stream; copies, not NCCL, between replicas that share a GPU). On a
machine without GPUs, splitting the CPU gives ``MirroredStrategy()`` one replica per logical
CPU device, as TensorFlow's does (TensorFlow's guides simulate replicas that way).

>>> import torch_distribute as td
>>> [d.name for d in td.config.list_physical_devices("CPU")]
['/physical_device:CPU:0']
>>> # gpu = td.config.list_physical_devices("GPU")[0]
>>> # td.config.set_logical_device_configuration(gpu, [td.config.LogicalDeviceConfiguration()] * 2)
>>> # td.MirroredStrategy().num_replicas_in_sync   # 2, on the one GPU

The library's own checks are switched here too, for every strategy (a strategy's own setting,
``strategy.set_loss_scaling_check``, wins): ``set_loss_scaling_check(False)`` accepts a loss
averaged over one replica's batch inside ``strategy.run`` (``docs/common-mistakes.md``);
``set_nonfinite_check("warn" | "raise" | "off")`` says what a non-finite gradient does;
``set_log_level`` sets the level of the ``torch_distribute`` logger (``log.py``).

Differences from TensorFlow: the configuration may change at any time (strategies made
before keep their devices); ``memory_limit`` (MiB) is the same for every logical GPU of a
physical one and their sum caps this process on that GPU
(``torch.cuda.set_per_process_memory_fraction``), since PyTorch's allocator has one pool per
physical GPU, not one per replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from torch_distribute import devices, log
from torch_distribute.devices import LogicalDevice
from torch_distribute.errors import InvalidArgumentError, InvalidDeviceError

__all__ = [
    "LogicalDevice",
    "LogicalDeviceConfiguration",
    "PhysicalDevice",
    "get_logical_device_configuration",
    "get_loss_scaling_check",
    "functions_run_eagerly",
    "get_nonfinite_check",
    "set_log_level",
    "list_logical_devices",
    "list_physical_devices",
    "run_functions_eagerly",
    "set_logical_device_configuration",
    "set_loss_scaling_check",
    "set_nonfinite_check",
]

_DEVICE_TYPES = ("CPU", "GPU")


class PhysicalDevice(NamedTuple):
    """A device of this machine: ``name`` like ``"/physical_device:GPU:0"``, ``device_type``."""

    name: str
    device_type: str


def _device_number(physical: PhysicalDevice) -> int:
    """The ``N`` of ``"/physical_device:GPU:N"`` (not a property: ``index`` is tuple's method)."""
    return int(physical.name.rsplit(":", 1)[1])


@dataclass(frozen=True)
class LogicalDeviceConfiguration:
    """One logical device of a physical one; ``memory_limit`` in MiB (GPUs only)."""

    memory_limit: int | None = None

    def __post_init__(self) -> None:
        limit = self.memory_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
            raise InvalidArgumentError(f"memory_limit is a positive number of MiB or None, got {limit!r}.")


_cpu_configuration: list[LogicalDeviceConfiguration] | None = None
_gpu_configurations: dict[int, list[LogicalDeviceConfiguration]] = {}


def _check_type(device_type: str | None) -> str | None:
    if device_type is None:
        return None
    spelled = device_type.upper()
    if spelled not in _DEVICE_TYPES:
        raise InvalidDeviceError(f"device_type must be 'CPU', 'GPU' or None, got {device_type!r}.")
    return spelled


def list_physical_devices(device_type: str | None = None) -> list[PhysicalDevice]:
    """The host CPU and every visible GPU (``device_type`` ``"CPU"``, ``"GPU"`` or None for both)."""
    wanted = _check_type(device_type)
    found = [PhysicalDevice("/physical_device:CPU:0", "CPU")]
    found += [PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(devices.physical_gpu_count())]
    return [d for d in found if wanted in (None, d.device_type)]


def list_logical_devices(device_type: str | None = None) -> list[LogicalDevice]:
    """The devices strategies can use; pass them (or their ``name``) as ``devices=``."""
    wanted = _check_type(device_type)
    found = [LogicalDevice("cpu", i) for i in range(devices.logical_cpu_count())]
    found += [LogicalDevice("cuda", i, p) for i, p in enumerate(devices.logical_gpu_map())]
    return [d for d in found if wanted in (None, d.device_type)]


def _physical(device: PhysicalDevice | str) -> PhysicalDevice:
    name = device.name if isinstance(device, PhysicalDevice) else device
    for candidate in list_physical_devices():
        if candidate.name == name:
            return candidate
    raise InvalidDeviceError(
        f"{device!r} is not a physical device of this machine: pass one of "
        f"{[d.name for d in list_physical_devices()]} (td.config.list_physical_devices())."
    )


def set_logical_device_configuration(device: PhysicalDevice | str,
                                     logical_devices: Sequence[LogicalDeviceConfiguration] | None) -> None:
    """Split ``device`` into ``len(logical_devices)`` logical devices (None undoes it).

    >>> cpu = list_physical_devices("CPU")[0]
    >>> set_logical_device_configuration(cpu, [LogicalDeviceConfiguration()] * 2)
    >>> [d.name for d in list_logical_devices("CPU")]
    ['cpu:0', 'cpu:1']
    >>> set_logical_device_configuration(cpu, None)
    """
    global _cpu_configuration
    physical = _physical(device)
    configurations = None if logical_devices is None else list(logical_devices)
    if configurations is not None:
        if not configurations or not all(isinstance(c, LogicalDeviceConfiguration) for c in configurations):
            raise InvalidArgumentError(
                "logical_devices is a non-empty list of td.config.LogicalDeviceConfiguration (or None)."
            )
    if physical.device_type == "CPU":
        if configurations and any(c.memory_limit is not None for c in configurations):
            raise InvalidArgumentError("memory_limit applies to GPUs only: leave it None for CPU devices.")
        _cpu_configuration = configurations
        devices.split_cpu(len(configurations) if configurations else 1)
        return
    limits = {c.memory_limit for c in configurations} if configurations else {None}
    if len(limits) > 1:
        raise InvalidArgumentError(
            f"The logical GPUs of one physical GPU share one memory pool in PyTorch, so give them all "
            f"the same memory_limit (or none), got {sorted(limits, key=str)}."
        )
    index = _device_number(physical)
    count = len(configurations) if configurations else 1
    devices.split_physical_gpu(index, count)
    limit = limits.pop()
    if limit is not None:  # a limit comes from the configurations: count is their number
        total = torch.cuda.get_device_properties(index).total_memory
        wanted = limit * 2**20 * count
        if wanted > total:
            raise InvalidArgumentError(
                f"{count} logical GPUs of {limit} MiB exceed {physical.name}'s "
                f"{total // 2**20} MiB."
            )
        torch.cuda.set_per_process_memory_fraction(wanted / total, index)
    elif index in _gpu_configurations:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
    if configurations:
        _gpu_configurations[index] = configurations
    else:
        _gpu_configurations.pop(index, None)


def get_logical_device_configuration(device: PhysicalDevice | str) -> list[LogicalDeviceConfiguration] | None:
    """What ``set_logical_device_configuration`` last set for ``device`` (None: not split)."""
    physical = _physical(device)
    if physical.device_type == "CPU":
        return None if _cpu_configuration is None else list(_cpu_configuration)
    configurations = _gpu_configurations.get(_device_number(physical))
    return None if configurations is None else list(configurations)


# -- the library's checks ----------------------------------------------------------------------
_loss_scaling_check = True


def set_loss_scaling_check(enabled: bool) -> None:
    """Whether ``backward()`` inside ``strategy.run`` with several replicas refuses a loss
    averaged over the replica's own batch (``td.LossScalingError``); on by default.

    Turn it off only for a per-replica mean you chose knowingly: the update is then
    ``num_replicas_in_sync`` times the one-device update.

    >>> set_loss_scaling_check(False)
    >>> get_loss_scaling_check()
    False
    >>> set_loss_scaling_check(True)
    """
    global _loss_scaling_check
    if not isinstance(enabled, bool):
        raise InvalidArgumentError(f"set_loss_scaling_check takes True or False, got {enabled!r}.")
    _loss_scaling_check = enabled


def get_loss_scaling_check() -> bool:
    """What ``set_loss_scaling_check`` last set (True by default)."""
    return _loss_scaling_check


_NONFINITE_MODES = ("warn", "raise", "off")
_nonfinite_check = "warn"


def set_nonfinite_check(mode: str) -> None:
    """What an optimizer step inside ``strategy.run`` does when the gradient summed over the
    replicas is inf or NaN: ``"warn"`` (the default; once, naming the step, the replica and
    the worker where it appeared), ``"raise"`` (``td.NonFiniteError``, before the update) or
    ``"off"``.

    >>> set_nonfinite_check("raise")
    >>> get_nonfinite_check()
    'raise'
    >>> set_nonfinite_check("warn")
    """
    global _nonfinite_check
    if mode not in _NONFINITE_MODES:
        raise InvalidArgumentError(f"set_nonfinite_check takes one of {_NONFINITE_MODES}, got {mode!r}.")
    _nonfinite_check = mode


def get_nonfinite_check() -> str:
    """What ``set_nonfinite_check`` last set (``"warn"`` by default)."""
    return _nonfinite_check


_run_functions_eagerly = False


def run_functions_eagerly(run_eagerly: bool) -> None:
    """TensorFlow's ``tf.config.run_functions_eagerly``: with ``True``, every ``td.function``
    runs its Python function as it is, uncompiled (the replica steps too), for debugging with
    print and pdb; ``input_signature`` is still checked.

    >>> import torch, torch_distribute as td
    >>> double = td.function(lambda x: x * 2)
    >>> run_functions_eagerly(True)
    >>> double(torch.ones(2)), double.experimental_get_tracing_count()
    (tensor([2., 2.]), 0)
    >>> run_functions_eagerly(False)
    """
    global _run_functions_eagerly
    if not isinstance(run_eagerly, bool):
        raise InvalidArgumentError(f"run_functions_eagerly takes True or False, got {run_eagerly!r}.")
    _run_functions_eagerly = run_eagerly


def functions_run_eagerly() -> bool:
    """What ``run_functions_eagerly`` last set (False by default)."""
    return _run_functions_eagerly


def set_log_level(level: int | str) -> None:
    """The level of the ``torch_distribute`` logger (``"INFO"``: what each strategy decided;
    ``"DEBUG"``: every collective between workers and its purpose), as ``TD_LOG_LEVEL`` sets
    it. The library adds no handler: configure ``logging`` to see the records.

    >>> import logging
    >>> set_log_level("DEBUG")
    >>> logging.getLogger("torch_distribute").level == logging.DEBUG
    True
    >>> set_log_level(logging.NOTSET)
    """
    if log.parse_level(level) is None:
        raise InvalidArgumentError(
            f"set_log_level takes a logging level (DEBUG, INFO, WARNING, ERROR, CRITICAL, or a "
            f"number >= 0), got {level!r}.")
    log.set_level(level)
