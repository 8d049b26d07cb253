"""Optimum ONNX Runtime worker: ``ORTModelForCausalLM`` on a ``kv_cache=True`` ONNX graph.

Imports only optimum-onnx (with onnxruntime, transformers and torch, its own
dependencies), numpy and the standard library. The artifact is the ``.onnx`` file of
an Optimum-ready folder (``layout="optimum"``: ``config.json`` and
``generation_config.json`` beside it) or that folder. The left-padded batch goes to
``generate`` with its attention mask, as a user of Optimum passes it; Optimum feeds
the graph's ``attention_mask`` / ``position_ids`` inputs itself (it silently drops the
mask of a graph without one). Greedy decoding with no end-of-sequence stop, so exactly
``max_new_tokens`` tokens per row. Teacher-forced logprobs come from one forward of
the padded batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _worker


def _load(artifact: str) -> Any:
    from optimum.onnxruntime import ORTModelForCausalLM
    from transformers import GenerationMixin

    _worker.refuse_code(artifact)
    _worker.disable_custom_generate(GenerationMixin)
    path = Path(artifact)
    folder, file_name = (path.parent, path.name) if path.is_file() else (path, None)
    model = ORTModelForCausalLM.from_pretrained(
        folder, file_name=file_name, use_cache=True, trust_remote_code=False
    )
    # generation_config.json names an end-of-sequence id; generate would stop a row there.
    model.generation_config.eos_token_id = None
    return model


def serve(ctx: _worker.Context) -> tuple[list[list[int]], list[list[float]]]:
    """Load the folder, score the prompts, then generate greedily."""
    import torch
    from transformers import GenerationConfig

    req = ctx.request
    ctx.options(())
    with ctx.stage("load"):
        model = _load(req["artifact"])
    ids = torch.tensor(req["input_ids"], dtype=torch.long)
    mask = torch.tensor(req["attention_mask"], dtype=torch.long)
    logprobs: list[list[float]] = []
    with ctx.stage("score"), torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.double()
        logp = torch.log_softmax(logits, dim=-1)
        for r, row in enumerate(req["attention_mask"]):
            first = row.index(1)
            logprobs.append(
                [float(logp[r, i, ids[r, i + 1]]) for i in range(first, ids.shape[1] - 1)]
            )
    new = int(req["max_new_tokens"])
    if new == 0:
        return [[] for _ in logprobs], logprobs
    with ctx.stage("generate"), torch.no_grad():
        config = GenerationConfig(
            max_new_tokens=new, do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=0
        )
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=config,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = [[int(t) for t in row] for row in out.sequences[:, ids.shape[1] :]]
    steps = _worker.Steps(len(tokens))
    for s, step in enumerate(out.logits):  # each step's raw logits, on the ORT cache
        for r, row in enumerate(step.double().tolist()):
            steps.add(r, row, tokens[r][s])
    steps.record(ctx)
    return tokens, logprobs


if __name__ == "__main__":
    raise SystemExit(
        _worker.main(
            "optimum-onnxruntime", "optimum.onnxruntime", ("optimum-onnx", "optimum"), serve
        )
    )
