"""onnxruntime-genai worker: its ``Generator`` on a ``kv_cache=True`` ONNX graph.

Imports only onnxruntime-genai, numpy and the standard library. The artifact is the
``.onnx`` file of a folder holding ``genai_config.json`` (``genai_config=True``) or that
folder. onnxruntime-genai finds padding by the config's ``pad_token_id`` and reads it
from the end of each row (``DefaultPositionInputs`` builds the mask and the position
ids backwards from the last non-pad token), so a left-padded row would be read as
real tokens: the prompts are re-padded on the right, that engine's convention, and a
prompt holding the pad id is refused. Greedy search (``top_k=1``); a row that stops
before ``max_new_tokens`` is refused rather than cut short. Teacher-forced logprobs
come from the logits of one prefill of the right-padded prompts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import _worker


def _right_padded(rows: list[list[int]], pad: int) -> Any:
    import numpy as np

    width = max(len(r) for r in rows)
    return np.array([r + [pad] * (width - len(r)) for r in rows], dtype=np.int32)


def _generator(og: Any, model: Any, batch: int, max_length: int) -> Any:
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=max_length, batch_size=batch, do_sample=False, top_k=1)
    return og.Generator(model, params)


def _greedy(
    og: Any, model: Any, rows: list[list[int]], pad: int, new: int, record: _worker.Steps
) -> list[list[int]]:
    import numpy as np

    ids = _right_padded(rows, pad)
    generator = _generator(og, model, len(rows), ids.shape[1] + new)
    generator.append_tokens(ids)
    steps: list[list[int]] = []
    while not generator.is_done() and len(steps) < new:
        # the logits this step chooses from: append_tokens (step 0) or the last
        # generate_next_token computed them (read after it, they are the next step's)
        logits = np.asarray(generator.get_logits(), dtype=np.float64)
        logits = logits.reshape(len(rows), -1, logits.shape[-1])[:, -1]
        generator.generate_next_token()
        steps.append([int(t) for t in generator.get_next_tokens()])
        for r, t in enumerate(steps[-1]):
            record.add(r, logits[r].tolist(), t)
    if len(steps) != new:
        raise RuntimeError(f"onnxruntime-genai stopped after {len(steps)} of {new} tokens")
    return [[step[r] for step in steps] for r in range(len(rows))]


def _scores(og: Any, model: Any, rows: list[list[int]], pad: int) -> list[list[float]]:
    import numpy as np

    ids = _right_padded(rows, pad)
    generator = _generator(og, model, len(rows), ids.shape[1] + 1)
    generator.append_tokens(ids)  # one prefill: the logits of every position
    logits = np.asarray(generator.get_output("logits"), dtype=np.float64)
    return [
        [_worker.log_softmax_at(list(logits[r, i]), row[i + 1]) for i in range(len(row) - 1)]
        for r, row in enumerate(rows)
    ]


def serve(ctx: _worker.Context) -> tuple[list[list[int]], list[list[float]]]:
    """Load the folder, score the prompts, then generate greedily."""
    import onnxruntime_genai as og

    req = ctx.request
    ctx.options(())
    rows = _worker.rows(req)
    with ctx.stage("load"):
        _worker.refuse_code(req["artifact"])  # no custom_ops_library, no shipped library
        path = Path(req["artifact"])
        folder = path.parent if path.is_file() else path
        config = json.loads((folder / "genai_config.json").read_text(encoding="utf-8"))
        pad = int(config["model"]["pad_token_id"])
        if any(pad in row for row in rows):
            raise ValueError(
                f"a prompt holds genai_config.json's pad_token_id {pad}: onnxruntime-genai "
                "would read it as padding"
            )
        model = og.Model(str(folder))
    ctx.notes.append("right-padded: onnxruntime-genai reads padding from the end of a row")
    with ctx.stage("score"):
        logprobs = _scores(og, model, rows, pad)
    new = int(req["max_new_tokens"])
    if new == 0:
        return [[] for _ in rows], logprobs
    steps = _worker.Steps(len(rows))
    with ctx.stage("generate"):
        tokens = _greedy(og, model, rows, pad, new, steps)
    steps.record(ctx)
    return tokens, logprobs


if __name__ == "__main__":
    raise SystemExit(
        _worker.main("onnxruntime-genai", "onnxruntime_genai", ("onnxruntime-genai",), serve)
    )
