"""Device names: ``"cuda:0"``, ``"/gpu:0"``, ``"/device:GPU:0"``, ``"cpu"``, ``"cpu:1"``, ``"/cpu:1"``.

CPU devices are *logical*: ``cpu:0`` and ``cpu:1`` are two replicas that both compute on the
host CPU (as TensorFlow's logical CPU devices do), which is how multi-replica code is tested
on a machine without GPUs. GPUs are physical unless ``split_physical_gpu`` (what
``td.config.set_logical_device_configuration`` calls) made several logical GPUs of one:
then ``cuda:N`` names the N-th logical GPU, counted through the physical GPUs in order, and
``torch_device`` is the physical GPU it runs on.

>>> canonicalize("/gpu:1").name
'cuda:1'
>>> canonicalize("/cpu:1").torch_device
device(type='cpu')
"""

from __future__ import annotations

import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from torch_distribute.errors import InvalidDeviceError

_PATTERN = re.compile(
    r"^(?:/job:[^/]+(?:/replica:\d+)?(?:/task:\d+)?)?/?(?:device:)?"
    r"(?P<kind>cpu|gpu|cuda)(?::(?P<index>\d+))?$",
    re.IGNORECASE,
)


@dataclass(frozen=True, order=True)
class LogicalDevice:
    """One replica's device: a kind (``"cpu"`` or ``"cuda"``), an index and, for a GPU, the
    physical GPU it runs on (the index itself unless GPUs were split into logical ones)."""

    kind: str
    index: int
    physical_index: int | None = field(default=None, compare=False)

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.index}"

    @property
    def torch_device(self) -> torch.device:
        """Where tensors of this replica live (every logical CPU maps to the host CPU)."""
        if self.kind == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", self.index if self.physical_index is None else self.physical_index)

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def device_type(self) -> str:
        """TensorFlow's spelling of the kind: ``"CPU"`` or ``"GPU"``."""
        return "GPU" if self.is_cuda else "CPU"

    def __str__(self) -> str:
        return self.name


DeviceLike = str | torch.device | LogicalDevice | int


def canonicalize(device: DeviceLike) -> LogicalDevice:
    """Parse any accepted device spelling into a ``LogicalDevice``; check CUDA indices exist."""
    if isinstance(device, LogicalDevice):
        parsed = device
    elif isinstance(device, torch.device):
        parsed = LogicalDevice(device.type if device.type == "cpu" else device.type,
                               device.index or 0)
        if parsed.kind not in ("cpu", "cuda"):
            raise InvalidDeviceError(
                f"Device {device} is not supported: use a CPU or CUDA device."
            )
    elif isinstance(device, int) and not isinstance(device, bool):
        parsed = LogicalDevice("cuda", device)
    elif isinstance(device, str):
        match = _PATTERN.match(device.strip())
        if match is None:
            raise InvalidDeviceError(
                f"Unknown device {device!r}: use 'cpu', 'cpu:N', '/cpu:N', 'cuda:N', '/gpu:N' "
                "or '/device:GPU:N'."
            )
        kind = match.group("kind").lower()
        parsed = LogicalDevice("cpu" if kind == "cpu" else "cuda", int(match.group("index") or 0))
    else:
        raise InvalidDeviceError(
            f"A device must be a string like 'cuda:0' or 'cpu:1', got {type(device).__name__}."
        )
    if parsed.is_cuda:
        physical = logical_gpu_map()
        if parsed.index >= len(physical):
            split = "" if len(physical) == physical_gpu_count() else f" ({len(physical)} logical GPUs)"
            raise InvalidDeviceError(
                f"Device {parsed.name} is not available: this machine has {physical_gpu_count()} CUDA "
                f"device(s){split}. Use CPU replicas ('cpu:0', 'cpu:1', ...) to run several replicas "
                "without GPUs, or td.config.set_logical_device_configuration to run several on one GPU."
            )
        parsed = LogicalDevice("cuda", parsed.index, physical[parsed.index])
    return parsed


def canonicalize_all(devices: Sequence[DeviceLike]) -> tuple[LogicalDevice, ...]:
    """Parse a list of devices; duplicates (after canonicalisation) are an error."""
    if isinstance(devices, (str, torch.device, LogicalDevice, int)):
        devices = [devices]
    parsed = tuple(canonicalize(d) for d in devices)
    if not parsed:
        raise InvalidDeviceError("The list of devices is empty: give at least one device.")
    seen: dict[LogicalDevice, int] = {}
    for position, device in enumerate(parsed):
        if device in seen:
            raise InvalidDeviceError(
                f"Device {device.name} appears twice (positions {seen[device]} and {position}) "
                "in the device list: each replica needs its own device. For several replicas "
                "on the CPU use distinct logical devices: 'cpu:0', 'cpu:1', ...; on one GPU, "
                "split it first with td.config.set_logical_device_configuration(gpu, "
                "[td.config.LogicalDeviceConfiguration()] * n) and use 'cuda:0', 'cuda:1', ..."
            )
        seen[device] = position
    return parsed


def local_devices(logical_cpus: bool = False) -> tuple[LogicalDevice, ...]:
    """Every visible (logical) GPU, else the CPU: every logical CPU device with
    ``logical_cpus`` (what ``MirroredStrategy()`` takes, as TensorFlow's does), else one.

    >>> split_cpu(2)
    >>> [d.name for d in local_devices(logical_cpus=True)], [d.name for d in local_devices()]
    (['cpu:0', 'cpu:1'], ['cpu:0'])
    >>> split_cpu(1)
    """
    physical = logical_gpu_map()
    if physical:
        return tuple(LogicalDevice("cuda", i, p) for i, p in enumerate(physical))
    return tuple(LogicalDevice("cpu", i) for i in range(logical_cpu_count() if logical_cpus else 1))


# -- logical CPUs ---------------------------------------------------------------------------
# The host CPU split into _cpu_split logical devices (td.config.set_logical_device_configuration).
_cpu_split = 1


def split_cpu(count: int) -> None:
    """Make ``count`` logical CPU devices from now on (1 undoes it)."""
    global _cpu_split
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise InvalidDeviceError(f"The CPU splits into a positive number of logical devices, got {count!r}.")
    _cpu_split = count


def logical_cpu_count() -> int:
    """How many logical CPU devices ``td.config`` made (1 unless split)."""
    return _cpu_split


def gpu_identity(device: LogicalDevice) -> str:
    """What names ``device``'s physical GPU across processes (its UUID where torch reports it)."""
    index = device.torch_device.index or 0
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"GPU-{uuid}" if uuid is not None else f"{socket.gethostname()}/cuda:{index}"


def share_a_gpu(devices: Sequence[LogicalDevice]) -> bool:
    """Whether two of ``devices`` are logical GPUs of the same physical GPU."""
    gpus = [d.torch_device for d in devices if d.is_cuda]
    return len(set(gpus)) < len(gpus)


# -- logical GPUs ---------------------------------------------------------------------------
# Physical GPU p is split into _gpu_splits[p] logical GPUs (1 where absent). Module state,
# as TensorFlow's logical device configuration is process state.
_gpu_splits: dict[int, int] = {}


def physical_gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def split_physical_gpu(physical_index: int, count: int) -> None:
    """Run ``count`` logical GPUs on physical GPU ``physical_index`` from now on (1 undoes it).

    Strategies made before keep the devices they were given."""
    if not 0 <= physical_index < physical_gpu_count():
        raise InvalidDeviceError(
            f"There is no physical GPU {physical_index}: this machine has {physical_gpu_count()}."
        )
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise InvalidDeviceError(f"A GPU splits into a positive number of logical GPUs, got {count!r}.")
    if count == 1:
        _gpu_splits.pop(physical_index, None)
    else:
        _gpu_splits[physical_index] = count


def logical_gpus_of(physical_index: int) -> int:
    """How many logical GPUs run on physical GPU ``physical_index``."""
    return _gpu_splits.get(physical_index, 1)


def logical_gpu_map() -> tuple[int, ...]:
    """The physical GPU of each logical GPU, in logical order."""
    return tuple(p for p in range(physical_gpu_count()) for _ in range(logical_gpus_of(p)))
