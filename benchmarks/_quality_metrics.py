"""The measurements of ``benchmarks/quality.py``: one perplexity, one agreement, for every producer.

Imports only torch and the standard library, so that each producer's child process
(exportlm's, ModelOpt's in the project venv, llm-compressor's in its own venv) measures
its model with these very functions. A model is measured through a ``logits_fn``:
``input_ids [1, seq] -> logits [1, seq, vocab]``, an HF model's forward (no KV cache)
or the callable :func:`exportlm.load_exported` returns.

* **Perplexity**: ``exp`` of the mean next-token negative log-likelihood over the
  evaluation ids cut into consecutive, non-overlapping windows (512 tokens by default),
  each window scored on its own (its first token has no context and is not scored);
  log-softmax in float32.
* **Agreement**: for each chat prompt, the bf16 model's greedy answer (32 tokens, computed
  once by ``quality.py`` with ``generate``); the share of answer positions where the measured
  model's greedy next token, given the prompt and the bf16 answer so far, equals the
  bf16 token (teacher-forced, one forward a prompt: a first divergence does not decide
  every later position, and no KV cache is needed, so every producer's model, the
  checkpoint runtimes included, is measured the same way).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


def hf_logits(model: Any) -> LogitsFn:
    """The ``logits_fn`` of a transformers causal LM (one forward, no KV cache)."""

    def run(ids: torch.Tensor) -> torch.Tensor:
        device = next(model.parameters()).device
        return model(ids.to(device), use_cache=False).logits

    return run


@torch.no_grad()
def perplexity(logits_fn: LogitsFn, ids: torch.Tensor, window: int = 512) -> float:
    """Perplexity of ``ids`` (int64 ``[tokens]``) in windows of ``window`` tokens."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window].unsqueeze(0)
        if chunk.shape[1] < 2:
            break
        logits = logits_fn(chunk).float()[0, :-1]
        target = chunk[0, 1:].to(logits.device)
        nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        count += int(target.numel())
    return float(torch.exp(torch.tensor(nll / count)))


@torch.no_grad()
def agreement(logits_fn: LogitsFn, prompts: list[torch.Tensor], answers: list[list[int]]) -> float:
    """Share of answer positions whose greedy next token equals the reference answer's."""
    same, total = 0, 0
    for prompt, answer in zip(prompts, answers, strict=True):
        ids = torch.cat([prompt, torch.tensor(answer[:-1], dtype=prompt.dtype)]).unsqueeze(0)
        picks = logits_fn(ids)[0, len(prompt) - 1 :].float().argmax(-1).tolist()
        same += sum(int(a == b) for a, b in zip(picks, answer, strict=True))
        total += len(answer)
    return same / total


def measure(logits_fn: LogitsFn, data: dict[str, Any]) -> dict[str, float]:
    """``{"ppl", "agree", "eval_s"}`` of one model on the run's evaluation data."""
    start = time.perf_counter()
    with float32_matmuls():
        ppl = perplexity(logits_fn, data["eval_ids"], data["window"])
        agree = agreement(logits_fn, data["prompts"], data["answers"])
    return {"ppl": ppl, "agree": agree, "eval_s": time.perf_counter() - start}


#: Set to ``1`` by ``quality.py --float32-matmuls`` for itself and every child.
FLOAT32_MATMULS = "QUALITY_FLOAT32_MATMULS"


def float32_matmuls() -> contextlib.AbstractContextManager[None]:
    """With ``--float32-matmuls``: the CPU bfloat16 matmuls run inside on float32 copies,
    each product rounded to bfloat16 (exportlm's ``float32_matmuls``: a bfloat16 GEMM's
    arithmetic up to accumulation order), for every producer's calibration and every
    evaluation alike. Without: nothing changes (and exportlm is not imported)."""
    if os.environ.get(FLOAT32_MATMULS) != "1":
        return contextlib.nullcontext()
    from exportlm.quant._gemm import float32_matmuls as matmuls  # EXPORTLM_FLOAT32_GEMM=1 too

    return matmuls()


def load_data(path: str | Path) -> dict[str, Any]:
    """The run's evaluation data and calibration batches (written by ``quality.py``)."""
    data: dict[str, Any] = torch.load(path, weights_only=True)
    return data


def peak_rss() -> int:
    """This process's peak resident set so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def export_done(result: dict[str, Any], spawned: float) -> None:
    """Record the export's wall seconds since the parent spawned this process (imports and
    loading included, as for the CLI; less the seconds of an evaluation run in between,
    ``result["mem"]["eval_s"]``) and the peak RSS up to now."""
    evaluated = (result.get("mem") or {}).get("eval_s", 0.0)
    result["export_s"] = time.time() - spawned - evaluated
    result["peak_rss"] = peak_rss()


def guarded(result: dict[str, Any], key: str, call: Callable[[], Any]) -> Any:
    """``call()``; on an exception, its type and message under ``result[key]`` instead."""
    try:
        return call()
    except Exception as err:  # a producer failing one step is a cell of the table
        result[key] = f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
        print(f"{key}: {result[key]}", file=sys.stderr, flush=True)
        return None


def write_result(path: str | Path, result: dict[str, Any]) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)
