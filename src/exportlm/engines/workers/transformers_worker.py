"""transformers worker: a checkpoint directory through ``AutoModelForCausalLM`` (with
compressed-tensors where the checkpoint needs it).

Imports only transformers (and the torch it runs on), numpy and the standard library.
The batch goes in left-padded with its attention mask and position ids; greedy
decoding runs on the model's own KV cache, recording each step's logprobs (the chosen
token's and the top 2) and the cache's length. ``trust_remote_code`` stays False,
``custom_generate`` is disabled (transformers 4.5x loads a local folder's
``custom_generate/generate.py`` regardless), a folder holding code is refused and
nothing is downloaded (``local_files_only``).
"""

from __future__ import annotations

import sys
from typing import Any

import _worker


def serve(ctx: _worker.Context) -> tuple[list[list[int]], list[list[float]]]:
    """Load the checkpoint, score the prompts teacher-forced, then decode greedily."""
    import torch
    import transformers

    req = ctx.request
    ctx.options(())
    with ctx.stage("load"):
        _worker.refuse_code(req["artifact"])
        _worker.disable_custom_generate(transformers.GenerationMixin)
        dtype: Any = getattr(torch, req["dtype"]) if req.get("dtype") else "auto"
        model = transformers.AutoModelForCausalLM.from_pretrained(
            req["artifact"], trust_remote_code=False, local_files_only=True, dtype=dtype
        ).eval()
    ids = torch.tensor(req["input_ids"])
    mask = torch.tensor(req["attention_mask"])
    pos = torch.tensor(_worker.position_ids(req["attention_mask"]))
    with ctx.stage("score"), torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
        lp = torch.log_softmax(out.logits.double(), dim=-1)[:, :-1]
        picked = lp.gather(-1, ids[:, 1:, None])[..., 0]
        first = (mask == 0).sum(-1)
        logprobs = [picked[r, int(first[r]) :].tolist() for r in range(ids.shape[0])]
    with ctx.stage("generate"), torch.no_grad():
        tokens = _greedy(ctx, model, ids, mask, pos, int(req["max_new_tokens"]))
    return tokens, logprobs


def next_positions(pos: Any, mask: Any) -> Any:
    """The position of the token a decode step feeds: one past each row's last."""
    return pos[:, -1:] + 1


def _cache_length(past: Any) -> int | None:
    length = getattr(past, "get_seq_length", None)
    return int(length()) if callable(length) else None


def _greedy(ctx: _worker.Context, model: Any, ids: Any, mask: Any, pos: Any, n: int) -> Any:
    """Greedy decoding on the model's KV cache, each step's logprobs recorded."""
    import torch

    new: list[Any] = []
    chosen: list[Any] = []
    tops: list[Any] = []
    cache: list[int | None] = []
    past, step_ids, step_pos = None, ids, pos
    for _ in range(n):
        out = model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=step_pos,
            past_key_values=past,
            use_cache=True,
        )
        past = out.past_key_values
        lp = torch.log_softmax(out.logits[:, -1].double(), dim=-1)
        nxt = lp.argmax(-1)
        new.append(nxt)
        chosen.append(lp.gather(-1, nxt[:, None])[:, 0])
        tops.append(torch.topk(lp, 2))
        cache.append(_cache_length(past))
        step_ids, step_pos = nxt[:, None], next_positions(step_pos, mask)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
    rows = range(ids.shape[0])
    top = [
        [[(int(t.indices[r, j]), float(t.values[r, j])) for j in range(2)] for t in tops]
        for r in rows
    ]
    lengths = None if None in cache else [[int(c or 0) for c in cache] for _ in rows]
    ctx.record_decode([[float(c[r]) for c in chosen] for r in rows], top, lengths)
    return [[int(t[r]) for t in new] for r in rows]


if __name__ == "__main__":
    sys.exit(_worker.main("transformers", "transformers", ("transformers",), serve))
