"""llm-compressor's round-to-nearest checkpoints of a model directory (run in its own venv).

``python _llmc_rtn_worker.py SOURCE OUT SCHEME [SCHEME ...]``: for each scheme of
:data:`SCHEMES`, loads ``SOURCE`` in its stored dtype, quantizes every linear but
``lm_head`` with llm-compressor's ``QuantizationModifier`` (data-free: every scale comes
from the weights) and saves it compressed into ``OUT/SCHEME``. It imports nothing from
this repository (llm-compressor's pins conflict with ours).
"""

from __future__ import annotations

import sys
from typing import Any

#: scheme -> compressed-tensors' weight args (and dynamic input args), as our recipes'.
SCHEMES: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {
    # W4A16 round-to-nearest (its preset, without GPTQ / AWQ), groups of 128
    "W4A16": ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}, None),
    # int8_wo: W8A16 per output channel (its W8A16 preset is in groups of 128)
    "W8A16_CHANNEL": ({"num_bits": 8, "type": "int", "strategy": "channel"}, None),
    # its FP8_DYNAMIC preset: channel weights, per-token inputs at run time
    "FP8_DYNAMIC": (
        {"num_bits": 8, "type": "float", "strategy": "channel"},
        {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
    ),
    # its W8A8 preset (without SmoothQuant): channel weights, per-token int8 inputs
    "W8A8": (
        {"num_bits": 8, "type": "int", "strategy": "channel"},
        {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True},
    ),
}


def main(source: str, out: str, *schemes: str) -> None:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    for name in schemes:
        weights, inputs = SCHEMES[name]
        scheme = QuantizationScheme(
            targets=["Linear"],
            weights=QuantizationArgs(symmetric=True, **weights),
            input_activations=None
            if inputs is None
            else QuantizationArgs(symmetric=True, **inputs),
        )
        model = AutoModelForCausalLM.from_pretrained(source, dtype="auto")
        modifier = QuantizationModifier(ignore=["lm_head"], config_groups={"group_0": scheme})
        oneshot(model=model, recipe=[modifier])
        model.save_pretrained(f"{out}/{name}", save_compressed=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
