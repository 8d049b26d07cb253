"""The multi-GPU placement of streamed layers: contiguous ranges sized to each device (pure)."""

from __future__ import annotations

import pytest

from exportlm.errors import LayerTooLargeError
from exportlm.stream import place_layers


def test_equal_devices_get_equal_contiguous_ranges() -> None:
    placement = place_layers([10] * 8, [50, 50])
    assert placement.devices == (0, 0, 0, 0, 1, 1, 1, 1)
    assert placement.boundaries == 1


def test_a_device_with_twice_the_memory_gets_about_twice_the_layers() -> None:
    placement = place_layers([10] * 9, [100, 50])
    assert len(placement.layers_on(0)) == 6
    assert len(placement.layers_on(1)) == 3


def test_layers_keep_their_order_so_activations_hop_once_per_boundary() -> None:
    placement = place_layers([5, 20, 5, 20, 5, 20], [40, 40, 40])
    assert list(placement.devices) == sorted(placement.devices)
    assert placement.boundaries == len(set(placement.devices)) - 1


def test_activations_are_reserved_on_every_device() -> None:
    with pytest.raises(LayerTooLargeError, match="fits no device"):
        place_layers([30], [40], activation_bytes=20)
    assert place_layers([20], [40], activation_bytes=20).devices == (0,)


def test_more_layers_than_all_devices_hold_is_refused_with_the_way_out() -> None:
    with pytest.raises(LayerTooLargeError, match="one layer at a time"):
        place_layers([10] * 10, [30, 30])


def test_one_device_takes_everything() -> None:
    assert place_layers([1, 2, 3], [100]).devices == (0, 0, 0)
    with pytest.raises(ValueError, match="at least one device"):
        place_layers([1], [])
