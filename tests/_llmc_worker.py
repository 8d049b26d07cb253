"""llm-compressor's own ``oneshot`` checkpoint of a model directory (run in its own venv).

``python _llmc_worker.py SOURCE RECIPE TEXT SAMPLES SEQ_LEN OUT``: loads ``SOURCE`` in its
stored dtype, quantizes it with llm-compressor's preset ``RECIPE`` (see :data:`RECIPES`)
over ``SAMPLES`` rows of ``SEQ_LEN`` tokens of the file ``TEXT`` (tokenized by the model's
own tokenizer, consecutive, no padding), saves it compressed into ``OUT`` with the
tokenizer, then prints ``{"llmcompressor": version, "compressed-tensors": version}``.

It runs in llm-compressor's interpreter (``make engines``: .venv-engines/llmcompressor),
whose pins conflict with ours, so it imports nothing from this repository.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from typing import Any

#: recipe -> (preset scheme, SmoothQuant first, an FP8 KV cache, calibration data used)
RECIPES: dict[str, tuple[str, bool, bool, bool]] = {
    "fp8": ("FP8", False, False, True),
    "fp8_kv": ("FP8", False, True, True),
    "w8a8_sq": ("W8A8", True, False, True),
    "nvfp4": ("NVFP4", False, False, True),
    "fp8_dynamic": ("FP8_DYNAMIC", False, False, False),
}
#: llm-compressor's FP8 KV-cache scheme (its examples/quantization_kv_cache recipe).
KV_SCHEME = {
    "num_bits": 8,
    "type": "float",
    "strategy": "tensor",
    "dynamic": False,
    "symmetric": True,
}


def _modifiers(recipe: str) -> list[Any]:
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    scheme, smooth, kv, _ = RECIPES[recipe]
    modifiers: list[Any] = [SmoothQuantModifier(smoothing_strength=0.8)] if smooth else []
    extra = {"kv_cache_scheme": KV_SCHEME} if kv else {}
    modifiers.append(
        QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"], **extra)
    )
    return modifiers


def main(source: str, recipe: str, text: str, samples: str, seq_len: str, out: str) -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(source, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(source)
    with open(text, encoding="utf-8") as handle:
        ids = tokenizer(handle.read())["input_ids"]
    width = int(seq_len)
    rows = [ids[i * width : (i + 1) * width] for i in range(int(samples))]
    if len(rows[-1]) != width:
        raise SystemExit(f"{text} has {len(ids)} tokens: fewer than {samples} x {seq_len}")
    data: dict[str, Any] = {}  # no data: llm-compressor's data-free pipeline
    if RECIPES[recipe][3]:
        masks = [[1] * len(row) for row in rows]
        data = {
            "dataset": Dataset.from_dict({"input_ids": rows, "attention_mask": masks}),
            "num_calibration_samples": len(rows),
            "shuffle_calibration_samples": False,
            "batch_size": len(rows),
            "pipeline": "basic",  # one batch through the whole model: the fastest on a CPU
        }
    oneshot(model=model, processor=tokenizer, recipe=_modifiers(recipe), **data)
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    versions = {
        name: importlib.metadata.version(name) for name in ("llmcompressor", "compressed-tensors")
    }
    print(json.dumps(versions))


if __name__ == "__main__":
    main(*sys.argv[1:7])
