"""OpenVINO worker: an ONNX file read and compiled by OpenVINO on the CPU.

Imports only openvino, numpy and the standard library. The compile properties come
from the request's options (the engine record's hints: f32 inference precision and
dynamic quantization off, without which OpenVINO's defaults are 0.05-0.08 off).
A graph that takes an ``attention_mask`` gets the left-padded batch with it (and
``position_ids`` where the graph takes them); a graph that takes ``input_ids`` only
gets each row on its own, unpadded. Greedy decoding reruns the whole sequence (the
graph has no cache); each step's logprobs are recorded.
"""

from __future__ import annotations

import sys
from typing import Any

import _worker

_OPTIONS = ("INFERENCE_PRECISION_HINT", "DYNAMIC_QUANTIZATION_GROUP_SIZE", "NUM_STREAMS")
_TAKEN = {"input_ids", "attention_mask", "position_ids"}


def serve(ctx: _worker.Context) -> tuple[list[list[int]], list[list[float]]]:
    """Compile the graph, then score and decode every row."""
    import numpy as np
    import openvino as ov

    req = ctx.request
    options = ctx.options(_OPTIONS)
    with ctx.stage("load"):
        _worker.refuse_code(req["artifact"])
        core = ov.Core()
        model = core.read_model(req["artifact"])
        names = {name for port in model.inputs for name in port.get_names()}
        unknown = sorted(
            next(iter(port.get_names())) for port in model.inputs if not port.get_names() & _TAKEN
        )
        if unknown or "input_ids" not in names:
            raise ValueError(
                f"this worker feeds input_ids / attention_mask / position_ids; the graph takes {sorted(names)}"
            )
        compiled = core.compile_model(model, "CPU", options)
    batched = "attention_mask" in names
    if not batched:
        ctx.notes.append("ran rows one by one, unpadded: the graph has no attention_mask input")

    def logits(ids: list[list[int]], mask: list[list[int]]) -> Any:
        feed: dict[str, Any] = {"input_ids": np.array(ids, dtype=np.int64)}
        if "attention_mask" in names:
            feed["attention_mask"] = np.array(mask, dtype=np.int64)
        if "position_ids" in names:
            feed["position_ids"] = np.array(_worker.position_ids(mask), dtype=np.int64)
        return np.asarray(compiled(feed)[compiled.outputs[0]], dtype=np.float64)

    groups = (
        [(req["input_ids"], req["attention_mask"])]
        if batched
        else [([row], [[1] * len(row)]) for row in _worker.rows(req)]
    )
    tokens: list[list[int]] = []
    logprobs: list[list[float]] = []
    with ctx.stage("score"):
        for ids, mask in groups:
            out = logits(ids, mask)
            for r, (row, m) in enumerate(zip(ids, mask)):
                first = m.index(1)
                logprobs.append(
                    [_logprob(out[r, i], row[i + 1]) for i in range(first, len(row) - 1)]
                )
    steps = _worker.Steps(len(req["input_ids"]))
    with ctx.stage("generate"):
        for ids, mask in groups:
            tokens.extend(
                _greedy(logits, ids, mask, int(req["max_new_tokens"]), steps, len(tokens))
            )
    steps.record(ctx)
    return tokens, logprobs


def _greedy(
    logits: Any, ids: Any, mask: Any, n: int, steps: _worker.Steps, done: int
) -> list[list[int]]:
    """Greedy tokens of one group (rerunning the whole sequence), each step recorded."""
    ids, mask = [list(r) for r in ids], [list(m) for m in mask]
    new: list[list[int]] = [[] for _ in ids]
    for _ in range(n):
        last = logits(ids, mask)[:, -1]
        for r, t in enumerate(last.argmax(-1)):
            steps.add(done + r, last[r].tolist(), int(t))
            ids[r].append(int(t))
            mask[r].append(1)
            new[r].append(int(t))
    return new


def _logprob(row: Any, index: int) -> float:
    top = row.max()
    import numpy as np

    return float(row[index] - top - np.log(np.exp(row - top).sum()))


if __name__ == "__main__":
    sys.exit(_worker.main("openvino", "openvino", ("openvino",), serve))
