"""The built-in ONNX engines, as data.

* ``openvino``: ``openvino.Core`` on a plain ONNX file (the float graph and INT8 QDQ).

* ``optimum-onnxruntime``: Optimum's ``ORTModelForCausalLM`` (``optimum-onnx``) on the
  folder ``layout="optimum"`` writes (``model.onnx``, ``config.json``,
  ``generation_config.json``); left-padded batches with their attention mask.
* ``onnxruntime-genai``: its ``Generator`` on the folder ``genai_config=True`` writes;
  right-padded, its own convention (see ``workers/ort_genai.py``).

``measured`` rows were run by ``tests/test_generation_padded.py`` on this project's CPU
machines, with the pins of ``docs/generation.md`` (three prompts of 3, 5 and 7 tokens,
8 new tokens: tokens equal to the eager model's, teacher-forced logprobs within 1e-4).
"""

from __future__ import annotations

from exportlm.engines.spec import F32_ATOL, Engine, Support, Tolerance

__all__ = ["ONNXRUNTIME_GENAI", "OPENVINO", "OPTIMUM_ORT"]

_KV = "kv_cache"
_MEASURED = "measured: tests/test_generation_padded.py, families {}"
_F32 = ("float32",)

OPTIMUM_ORT = Engine(
    name="optimum-onnxruntime",
    module="optimum.onnxruntime",
    distributions=("optimum-onnx", "optimum"),
    worker="optimum_ort.py",
    table_version="0.1.0",
    table=(Support("onnx", _KV, dtypes=_F32, evidence=_MEASURED.format("llama, qwen3_moe")),),
    tolerances=(
        Tolerance(
            F32_ATOL, "measured <= 2e-6 (optimum-onnx 0.1.0, onnxruntime 1.32.0; llama, qwen3_moe)"
        ),
    ),
    notes=(
        "give its interpreter with EXPORTLM_ENGINE_OPTIMUM_ONNXRUNTIME "
        "(optimum-onnx 0.1.0, onnxruntime 1.32.0, torch 2.13.0 CPU). Measured: a GQA "
        "mixtral graph fails there, as optimum-onnx 0.1.0 sizes the empty past with "
        "num_attention_heads for model types outside its list (modeling_decoder.py)"
    ),
)

ONNXRUNTIME_GENAI = Engine(
    name="onnxruntime-genai",
    module="onnxruntime_genai",
    distributions=("onnxruntime-genai",),
    worker="ort_genai.py",
    table_version="0.18.0",
    table=(
        Support("onnx", _KV, dtypes=_F32, evidence=_MEASURED.format("llama, mixtral, qwen3_moe")),
    ),
    notes="give its interpreter with EXPORTLM_ENGINE_ONNXRUNTIME_GENAI (onnxruntime-genai 0.18.0)",
    tolerances=(
        Tolerance(
            F32_ATOL, "measured <= 2e-6 (onnxruntime-genai 0.18.0; llama, mixtral, qwen3_moe)"
        ),
    ),
)

_OV_HINTS = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
_OV_DEFAULTS = (
    "its defaults (bf16/f16 inference precision, dynamic quantization) are 0.047-0.078 off"
)

OPENVINO = Engine(
    name="openvino",
    module="openvino",
    distributions=("openvino",),
    worker="openvino_worker.py",
    table_version="2026.4.1",
    table=(
        Support(
            "onnx",
            "plain",
            None,
            dtypes=("float32",),
            devices=("cpu",),
            evidence=f"measured with f32 inference precision, dynamic quantization off; {_OV_DEFAULTS}",
            hints=_OV_HINTS,
        ),
        Support(
            "onnx",
            "plain",
            "int8",
            dtypes=("float32",),
            devices=("cpu",),
            evidence="issue 19: INT8 QDQ within 3.7e-6 of onnxruntime with the f32 hints",
            hints=_OV_HINTS,
        ),
        Support(
            "onnx",
            "plain",
            "fp8",
            dtypes=("float32",),
            devices=(),
            limit=(
                "engine bug: OpenVINO 2026.4.1 rounds some FP8 values wrongly (44 of 20001 in "
                "one QDQ pair), 0.27 off onnxruntime"
            ),
            evidence="issue 19",
            hints=_OV_HINTS,
        ),
    ),
    hints=_OV_HINTS,
    notes="`make engines` (openvino 2026.4.1)",
    tolerances=(
        Tolerance(
            F32_ATOL,
            "measured 1.1e-5 (OpenVINO 2026.4.1, f32 inference precision, dynamic quant off)",
        ),
    ),
)
