"""Toy model family ``example_tiny``: a row of the conformance matrix.

The family is a :class:`~exportlm.models.ModelFamily`, so it can declare *why* its
forward fails some ways of capturing a model: it is a plain ``DecoderModel``,
whose KV-cache tuple TorchScript cannot type, so it shares the built-in decoder's
cause (``DECODER_SCRIPT_CAUSE``, ``None`` on a torch that scripts it). Every
target that declares ``capture="torchscript-script"`` (the built-in
``torchscript:script`` row among them) gets this family's items as declared
failures with that reason; the family names no target.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from exportlm.models import DECODER_SCRIPT_CAUSE, ModelFamily, build_model

__all__ = ["build_example_tiny", "example_tiny"]


def build_example_tiny(seed: int = 0, **overrides: Any) -> nn.Module:
    """A one-layer plain decoder; same ``seed`` and ``overrides`` give the same weights."""
    return build_model("decoder", seed, **{"num_layers": 1, **overrides})


#: What the ``exportlm.models`` entry point names: the factory and its failure causes.
example_tiny = ModelFamily(
    build_example_tiny,
    causes=() if DECODER_SCRIPT_CAUSE is None else (DECODER_SCRIPT_CAUSE,),
)
