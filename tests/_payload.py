"""What the trust tests share: a small model to export and a pickle payload that leaves a mark.

A test that must show a payload did *not* run needs one that would: unpickling a
:class:`Payload` writes its marker file, so "the marker is absent" means nothing ran.
"""

from __future__ import annotations

import pathlib
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from exportlm.export import export_model
from exportlm.models import DecoderConfig, DecoderModel

__all__ = ["Payload", "export_quietly", "small_model"]


def small_model() -> DecoderModel:
    """A one-layer decoder with seeded weights (exports in well under a second)."""
    torch.manual_seed(0)
    return DecoderModel(DecoderConfig(hidden_size=32, intermediate_size=64, num_layers=1)).eval()


def export_quietly(target: str, path: Path) -> Path:
    """:func:`small_model` exported to ``path`` with ``target``, deprecation warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return export_model(target, small_model(), path)


class Payload:
    """Unpickling this writes ``"pwned"`` into the marker file: the harmless stand-in for an attack."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., object], tuple[object, ...]]:
        return pathlib.Path.write_text, (pathlib.Path(self.marker), "pwned")
