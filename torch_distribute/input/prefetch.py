"""Per-replica prefetching (``InputOptions.experimental_per_replica_buffer_size``).

Steps are read ahead synchronously, on the caller's thread, so the order in which the data
pipeline and the training step draw random numbers stays fixed (no background thread).
Where a replica's device is a GPU, the copies of the steps read ahead are issued on a side
stream and so overlap the current step; the stream that uses a batch waits for its copy.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from torch_distribute import nest
from torch_distribute.input.batching import to_device


def default_buffer_size(devices: list[torch.device], fetch_to_device: bool) -> int:
    """One step ahead where batches are copied to a GPU; none where there is nothing to copy."""
    return 1 if fetch_to_device and any(d.type == "cuda" for d in devices) else 0


class DeviceFeeder:
    """Moves each replica's batch to its device (or leaves it where it is)."""

    def __init__(self, devices: list[torch.device], fetch_to_device: bool, side_streams: bool):
        self._devices = list(devices)
        self._fetch = fetch_to_device
        self._streams: dict[torch.device, Any] = {}
        if fetch_to_device and side_streams and torch.cuda.is_available():
            for device in self._devices:
                if device.type == "cuda" and device not in self._streams:
                    self._streams[device] = torch.cuda.Stream(device=device)

    def send(self, pieces: list[Any]) -> list[Any]:
        """Start the copies (on the side stream of a GPU replica)."""
        if not self._fetch:
            return list(pieces)
        placed = []
        for piece, device in zip(pieces, self._devices, strict=True):
            stream = self._streams.get(device)
            if stream is None:
                placed.append(to_device(piece, device))
                continue
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                placed.append(to_device(piece, device))
        return placed

    def receive(self, pieces: list[Any]) -> list[Any]:
        """Make each GPU replica's current stream wait for its batch's copy."""
        for piece, device in zip(pieces, self._devices, strict=True):
            stream = self._streams.get(device)
            if stream is None:
                continue
            current = torch.cuda.current_stream(device)
            current.wait_stream(stream)
            for tensor in nest.leaves(piece):
                if tensor.device.type == "cuda":
                    tensor.record_stream(current)  # its memory is not reused before the step is done
        return pieces


class LocalStep(NamedTuple):
    """One step's batches of this worker's replicas, in replica order, and the digest of the
    global batch they were cut from (0 when the workers do not compare it)."""

    pieces: list[Any]
    digest: int = 0


class StepBuffer:
    """The per-replica batches of the next steps: ``size`` steps are read ahead of the one taken.

    ``read_step()`` returns one step's ``LocalStep``, or ``None`` at the end of this worker's data.
    """

    def __init__(self, read_step: Callable[[], LocalStep | None], feeder: DeviceFeeder, size: int):
        self._read_step = read_step
        self._feeder = feeder
        self._size = size
        self._queue: deque[LocalStep] = deque()
        self._ended = False

    def _read(self) -> bool:
        if self._ended:
            return False
        step = self._read_step()
        if step is None:
            self._ended = True
            return False
        self._queue.append(LocalStep(self._feeder.send(step.pieces), step.digest))
        return True

    def peek(self) -> list[Any] | None:
        """The next step's batches without taking them (for their shapes and dtypes)."""
        if not self._queue:
            self._read()
        return self._queue[0].pieces if self._queue else None

    def take(self) -> LocalStep | None:
        """The next step, its batches ready on their devices; ``None`` when this worker has none."""
        if not self._queue and not self._read():
            return None
        step = self._queue.popleft()
        while len(self._queue) < self._size and self._read():
            pass
        return LocalStep(self._feeder.receive(step.pieces), step.digest)
