"""Worker: greedy tokens and teacher-forced logprobs from onnxruntime-genai.

Runs in the engine's own interpreter (``onnxruntime-genai`` + numpy), never in
exportlm's: it imports only the engine, numpy and the standard library. It reads one
JSON request on stdin and writes one JSON answer on stdout::

    request:  {"artifact": DIR (holding genai_config.json), "prompts": [[id, ...], ...],
               "max_new_tokens": N}
    answer:   {"engine": "onnxruntime-genai", "versions": {...}, "padding": "right",
               "tokens": [[id] * N per prompt],
               "logprobs": [[log p(x[t+1] | x[:t+1]) for every position of prompt + tokens]]}

onnxruntime-genai finds padding by the ``pad_token_id`` of ``genai_config.json`` and
reads it from the end of each row (``DefaultPositionInputs`` builds the mask and the
position ids backwards from the last non-pad token), so the batch is padded on the
right, which is that engine's convention; a left-padded row would be read as real
tokens. Greedy search (``top_k=1``); a row that produced end-of-sequence is refused
as an answer rather than cut short. A failure writes ``{"error": ...}`` and exits 1.
"""

from __future__ import annotations

import json
import sys
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any


def _versions() -> dict[str, str]:
    found = {}
    for name in ("onnxruntime-genai", "onnxruntime", "numpy"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def _right_pad(rows: list[list[int]], pad: int) -> Any:
    import numpy as np

    width = max(len(r) for r in rows)
    return np.array([list(r) + [pad] * (width - len(r)) for r in rows], dtype=np.int32)


def _generator(og: Any, model: Any, batch: int, max_length: int) -> Any:
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=max_length, batch_size=batch, do_sample=False, top_k=1)
    return og.Generator(model, params)


def _greedy(og: Any, model: Any, prompts: list[list[int]], pad: int, new: int) -> list[list[int]]:
    ids = _right_pad(prompts, pad)
    generator = _generator(og, model, len(prompts), ids.shape[1] + new)
    generator.append_tokens(ids)
    steps: list[list[int]] = []
    while not generator.is_done() and len(steps) < new:
        generator.generate_next_token()
        steps.append([int(t) for t in generator.get_next_tokens()])
    return [[step[row] for step in steps] for row in range(len(prompts))]


def _logprobs(og: Any, model: Any, rows: list[list[int]], pad: int) -> list[list[float]]:
    import numpy as np

    ids = _right_pad(rows, pad)
    generator = _generator(og, model, len(rows), ids.shape[1] + 1)
    generator.append_tokens(ids)  # one prefill over every row: logits of every position
    logits = np.asarray(generator.get_output("logits"), dtype=np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return [
        [float(logp[r, t, row[t + 1]]) for t in range(len(row) - 1)] for r, row in enumerate(rows)
    ]


def run(request: dict[str, Any]) -> dict[str, Any]:
    import onnxruntime_genai as og

    folder = Path(request["artifact"])
    config = json.loads((folder / "genai_config.json").read_text(encoding="utf-8"))
    pad = int(config["model"]["pad_token_id"])
    prompts = [list(map(int, p)) for p in request["prompts"]]
    if any(pad in p for p in prompts):
        raise ValueError(
            f"a prompt holds the pad token id {pad} of genai_config.json; onnxruntime-genai "
            "would mask it as padding"
        )
    new = int(request["max_new_tokens"])
    model = og.Model(str(folder))
    tokens = _greedy(og, model, prompts, pad, new)
    if any(len(t) != new for t in tokens):
        raise RuntimeError(f"onnxruntime-genai stopped before {new} tokens: {tokens}")
    rows = [p + t for p, t in zip(prompts, tokens, strict=True)]
    return {
        "engine": "onnxruntime-genai",
        "versions": _versions(),
        "padding": "right",
        "tokens": tokens,
        "logprobs": _logprobs(og, model, rows, pad),
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
