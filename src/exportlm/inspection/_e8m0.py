"""The values of E8M0 block scales (the MX formats: ``mxfp4``, ``mxfp8``).

An E8M0 scale is a biased power-of-two exponent stored as ``uint8``
(``2 ** (code - 127)``); the code 255 is its NaN (OCP Microscaling spec v1.0,
section 5.4.1), which makes every value of the block NaN in vLLM's and
compressed-tensors' dequantization. The float scales' rule (``scale-nonfinite``,
:mod:`~exportlm.inspection._values`) reads only float dtypes, so the integer
scales of a layer whose format declares its scale leaf ``uint8`` are read here,
under the same rule.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from exportlm.errors import MalformedCheckpointError
from exportlm.inspection._files import Checkpoint
from exportlm.inspection._layers import QuantizedLayer
from exportlm.inspection._rules import RULES, Finding

__all__ = ["e8m0_findings"]

#: The E8M0 code of NaN.
_E8M0_NAN = 255


def _e8m0_scales(checkpoint: Checkpoint, layers: list[QuantizedLayer]) -> list[str]:
    """The stored ``uint8`` scale tensors of layers whose format declares a ``uint8`` scale."""
    names: set[str] = set()
    for layer in layers:
        if layer.spec is None:
            continue
        for leaf in layer.spec.weight_leaves:
            info = layer.leaves.get(leaf.name)
            uint8_scale = leaf.source != "data" and leaf.dtype == torch.uint8
            stored = info is not None and info.dtype == "U8" and checkpoint.readable(info.name)
            if uint8_scale and stored and info is not None:
                names.add(info.name)
    return sorted(names)


def e8m0_findings(checkpoint: Checkpoint, layers: list[QuantizedLayer]) -> Iterator[Finding]:
    """``scale-nonfinite`` for each E8M0 scale that holds the NaN code 255."""
    try:
        for name, tensor in checkpoint.iter_values(_e8m0_scales(checkpoint, layers)):
            bad = int((tensor == _E8M0_NAN).sum())
            if bad:
                file = checkpoint.tensors[name].file
                yield RULES["scale-nonfinite"].finding(
                    name,
                    f"{name} holds {bad} E8M0 NaN code(s) (255) of {tensor.numel()} (in {file}): "
                    "every value of those blocks dequantizes to NaN. The checkpoint is "
                    "corrupted; export it again",
                    count=bad,
                    file=file,
                )
    except MalformedCheckpointError as err:  # a header sound to us that safetensors refuses
        yield RULES["shard-unreadable"].finding(Path(str(err.path)).name, str(err))
