"""The ONNX Runtime engines that generate from a ``kv_cache=True`` ONNX graph, as data.

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

from exportlm.engines.spec import Engine, Support

__all__ = ["ONNXRUNTIME_GENAI", "OPTIMUM_ORT"]

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
)
