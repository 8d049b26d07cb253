"""Worker: greedy tokens and teacher-forced logprobs from Optimum's ``ORTModelForCausalLM``.

Runs in the engine's own interpreter (``optimum-onnx`` + ``onnxruntime`` + torch), never
in exportlm's: it imports only the engine, numpy and the standard library. It reads one
JSON request on stdin and writes one JSON answer on stdout::

    request:  {"artifact": DIR, "prompts": [[id, ...], ...], "max_new_tokens": N,
               "pad_token_id": P, "file_name": "model.onnx" (optional)}
    answer:   {"engine": "optimum-onnxruntime", "versions": {...},
               "tokens": [[id] * N per prompt],
               "logprobs": [[log p(x[t+1] | x[:t+1]) for every position of prompt + tokens]]}

The batch is left-padded with ``pad_token_id`` and an ``attention_mask`` of 0 over the
padding, as a user of ``generate`` would pass it. Greedy decoding, no end-of-sequence
stop (``eos_token_id=None``), so exactly ``N`` tokens per prompt. A failure to load or run
writes ``{"error": ...}`` and exits 1.
"""

from __future__ import annotations

import json
import sys
import traceback
from importlib import metadata
from typing import Any


def _versions() -> dict[str, str]:
    found = {}
    for name in ("optimum-onnx", "optimum", "onnxruntime", "transformers", "torch"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def _left_pad(prompts: list[list[int]], pad: int) -> tuple[list[list[int]], list[list[int]]]:
    width = max(len(p) for p in prompts)
    ids = [[pad] * (width - len(p)) + list(p) for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return ids, mask


def run(request: dict[str, Any]) -> dict[str, Any]:
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM
    from transformers import GenerationConfig

    model = ORTModelForCausalLM.from_pretrained(
        request["artifact"], file_name=request.get("file_name"), use_cache=True
    )
    # The directory's generation_config.json names an eos token; generate would merge it
    # back into the config below and stop a row early. The comparison wants N tokens.
    model.generation_config.eos_token_id = None
    prompts = request["prompts"]
    new = int(request["max_new_tokens"])
    pad = int(request["pad_token_id"])
    ids, mask = _left_pad(prompts, pad)
    input_ids, attention_mask = torch.tensor(ids), torch.tensor(mask)
    config = GenerationConfig(
        max_new_tokens=new, do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=pad
    )
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=config
        )
    tokens = out[:, input_ids.shape[1] :]
    full = torch.cat([input_ids, tokens], dim=1)
    full_mask = torch.cat([attention_mask, torch.ones_like(tokens)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=full_mask, use_cache=False).logits
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = logprobs[:, :-1].gather(-1, full[:, 1:, None])[..., 0]
    rows = []
    for row, prompt in enumerate(prompts):
        start = full.shape[1] - len(prompt) - new  # the row's first real position
        rows.append([float(v) for v in picked[row, start:]])
    return {
        "engine": "optimum-onnxruntime",
        "versions": _versions(),
        "tokens": tokens.tolist(),
        "logprobs": rows,
    }


def main() -> int:
    try:
        answer = run(json.load(sys.stdin))
    except Exception as err:  # the engine's own message is the answer
        json.dump(
            {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()}, sys.stdout
        )
        return 1
    json.dump(answer, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
