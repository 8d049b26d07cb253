"""Toy model family ``example_tiny``: a row of the conformance matrix."""

from __future__ import annotations

from typing import Any

from torch import nn

from exportlm.models import build_model

__all__ = ["build_example_tiny"]


def build_example_tiny(seed: int = 0, **overrides: Any) -> nn.Module:
    """A one-layer plain decoder; same ``seed`` and ``overrides`` give the same weights."""
    return build_model("decoder", seed, **{"num_layers": 1, **overrides})
