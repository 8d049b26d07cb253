"""Rule rows of this round's quantization schemes, as plain data.

Each row is ``(id, severity, loaders, summary)``; :mod:`exportlm.inspection._rules`
turns them into :class:`~exportlm.inspection.Rule` records at the end of its table (so
this module imports nothing of it). The code that evaluates a row lives in the module
named for its scheme (``_w4a8``, ``_w4afp8``).
"""

from __future__ import annotations

__all__ = ["SCHEME_RULE_ROWS"]

#: ``(id, severity value, loaders, summary)`` per rule, in the order of ``docs/checkpoint-rules.md``.
SCHEME_RULE_ROWS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    (
        "w4a8-fp8-range",
        "error",
        ("TensorRT-LLM",),
        "A W4A8_AWQ layer's INT4 values fit FP8 after its second scale: "
        "7 x max(weight_scale) <= 448 x weight_scale_2.",
    ),
    (
        "w4afp8-group-size",
        "warning",
        ("vLLM",),
        "A compressed-tensors W4AFP8 layer (INT4 groups, FP8 per-token inputs) is in groups "
        "of 128, the only size vLLM's W4AFP8 kernel takes.",
    ),
    (
        "fp8-pb-wo-tile-size",
        "warning",
        ("vLLM",),
        "A ModelOpt FP8_PB_WO layer (whose config records no tile) is in 128 x 128 tiles, the "
        "only size vLLM's ModelOpt FP8_PB_WO reads; exportlm's loader reads any tile from the "
        "scale's shape.",
    ),
    (
        "fp8-block-fused-rows",
        "warning",
        ("vLLM",),
        "An FP8 block layer that vLLM fuses with the projection after it (q_proj, k_proj into "
        "qkv_proj; gate_proj into gate_up_proj) has a whole number of tiles of rows.",
    ),
    (
        "mxfp4-blocks-outside-experts",
        "error",
        ("vLLM", "transformers"),
        "In gpt-oss's MXFP4 layout (quant_method 'mxfp4') only experts modules store "
        "<p>_blocks / <p>_scales; every other module is float.",
    ),
    (
        "mxfp4-float-experts",
        "error",
        ("vLLM", "transformers"),
        "Every experts module of gpt-oss's MXFP4 layout that modules_to_not_convert does not "
        "cover stores its projections as <p>_blocks / <p>_scales, not float.",
    ),
    (
        "mxfp4-float-experts-listed",
        "warning",
        ("vLLM",),
        "No experts module of gpt-oss's MXFP4 layout is float even where modules_to_not_convert "
        "covers it: vLLM reads no modules_to_not_convert and quantizes every experts module.",
    ),
    (
        "mxfp4-entry-not-evaluated",
        "warning",
        ("transformers",),
        "Every modules_to_not_convert entry of gpt-oss's MXFP4 layout is one inspect matches as "
        "transformers' re.match does (no backreference, lookaround, atomic group, possessive "
        "repeat, conditional or inline flag; at most 1000 automaton states).",
    ),
    (
        "mxfp4-excluded-but-quantized",
        "warning",
        ("transformers",),
        "No module that gpt-oss's modules_to_not_convert covers (as transformers matches it) "
        "stores <p>_blocks / <p>_scales.",
    ),
)
