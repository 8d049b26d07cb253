"""The graph interface the ``onnx`` exporter writes and its runtime feeds.

``input_ids`` always, ``attention_mask`` optionally (transformers models get one,
see :mod:`exportlm.export.onnx.export`), one ``logits`` output; batch and
sequence axes named ``batch`` / ``sequence`` when dynamic.
"""

from __future__ import annotations

INPUT_NAMES = ("input_ids", "attention_mask")
OUTPUT_NAMES = ("logits",)
#: Names of the dynamic axes of ``input_ids`` and ``logits``.
AXES = {0: "batch", 1: "sequence"}
