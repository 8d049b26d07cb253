"""Which device quantizes which decoder layer on a multi-GPU runner (a pure function).

The plan (``docs/decisions/0007-streaming-layer-placement.md``): a device map of
contiguous layer ranges, as accelerate's ``infer_auto_device_map`` builds one, sized to
each device's free memory. Layers keep their order, so the sequential calibration moves
the activations from one device to the next once per range boundary, and every device
holds only its own range. :func:`place_layers` decides it from numbers alone, so it is
tested on a machine without GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from exportlm.errors import LayerTooLargeError

__all__ = ["Placement", "place_layers"]


@dataclass(frozen=True)
class Placement:
    """``devices[i]`` is the device index of layer ``i``; ``boundaries`` counts device hops."""

    devices: tuple[int, ...]

    @property
    def boundaries(self) -> int:
        """How many times the activations move between devices (once per range change)."""
        return sum(1 for a, b in zip(self.devices, self.devices[1:]) if a != b)

    def layers_on(self, device: int) -> tuple[int, ...]:
        """The layers device ``device`` quantizes, in order."""
        return tuple(i for i, d in enumerate(self.devices) if d == device)


def place_layers(
    layer_bytes: Sequence[int], free_bytes: Sequence[int], activation_bytes: int = 0
) -> Placement:
    """Contiguous ranges of layers per device, balanced by bytes, each within its device.

    Every device keeps ``activation_bytes`` free for the calibration activations. The
    ranges follow the devices' share of the free memory (a device with twice the memory
    gets about twice the bytes); a device left with no layers is simply unused.

    Raises:
        LayerTooLargeError: a layer fits no device, or the layers do not fit all devices
            together (then stream them one at a time instead: a single device suffices).
        ValueError: no devices.
    """
    if not free_bytes:
        raise ValueError("place_layers needs at least one device")
    room = [max(0, f - activation_bytes) for f in free_bytes]
    total, capacity = sum(layer_bytes), sum(room)
    if any(size > max(room) for size in layer_bytes):
        raise LayerTooLargeError(
            f"a layer of {max(layer_bytes)} bytes fits no device (largest free after "
            f"activations: {max(room)} bytes); expected a device that holds one layer"
        )
    if total > capacity:
        raise LayerTooLargeError(
            f"{len(layer_bytes)} layers ({total} bytes) do not fit the {len(room)} devices "
            f"({capacity} bytes free); stream them one layer at a time on one device instead"
        )
    devices: list[int] = []
    device, used, placed = 0, 0, 0
    for size in layer_bytes:
        # share of the bytes this device should take: its part of the capacity
        target = total * sum(room[: device + 1]) / capacity
        if devices and (placed + size / 2 > target or used + size > room[device]):
            device, used = _next_device(device, size, room)
        devices.append(device)
        used += size
        placed += size
    return Placement(tuple(devices))


def _next_device(device: int, size: int, room: Sequence[int]) -> tuple[int, int]:
    for candidate in range(device + 1, len(room)):
        if size <= room[candidate]:
            return candidate, 0
    raise LayerTooLargeError(
        f"the remaining layers do not fit the devices after device {device}; "
        "stream them one layer at a time on one device instead"
    )
