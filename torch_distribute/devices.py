"""Device names: ``"cuda:0"``, ``"/gpu:0"``, ``"/device:GPU:0"``, ``"cpu"``, ``"cpu:1"``, ``"/cpu:1"``.

CPU devices are *logical*: ``cpu:0`` and ``cpu:1`` are two replicas that both compute on the
host CPU (as TensorFlow's logical CPU devices do), which is how multi-replica code is tested
on a machine without GPUs.

>>> canonicalize("/gpu:1").name
'cuda:1'
>>> canonicalize("/cpu:1").torch_device
device(type='cpu')
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from torch_distribute.errors import InvalidDeviceError

_PATTERN = re.compile(
    r"^(?:/job:[^/]+(?:/replica:\d+)?(?:/task:\d+)?)?/?(?:device:)?"
    r"(?P<kind>cpu|gpu|cuda)(?::(?P<index>\d+))?$",
    re.IGNORECASE,
)


@dataclass(frozen=True, order=True)
class LogicalDevice:
    """One replica's device: a kind (``"cpu"`` or ``"cuda"``) and an index."""

    kind: str
    index: int

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.index}"

    @property
    def torch_device(self) -> torch.device:
        """Where tensors of this replica live (every logical CPU maps to the host CPU)."""
        if self.kind == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", self.index)

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

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
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if parsed.index >= available:
            raise InvalidDeviceError(
                f"Device {parsed.name} is not available: this machine has {available} CUDA "
                "device(s). Use CPU replicas ('cpu:0', 'cpu:1', ...) to run several replicas "
                "without GPUs."
            )
    return parsed


def canonicalize_all(devices: list[DeviceLike] | tuple[DeviceLike, ...]) -> tuple[LogicalDevice, ...]:
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
                "on the CPU use distinct logical devices: 'cpu:0', 'cpu:1', ..."
            )
        seen[device] = position
    return parsed


def local_devices() -> tuple[LogicalDevice, ...]:
    """Every visible GPU, else the one CPU device."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count:
        return tuple(LogicalDevice("cuda", i) for i in range(count))
    return (LogicalDevice("cpu", 0),)
