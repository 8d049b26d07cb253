"""How far vLLM's bfloat16 answers move from the float32 eager model, beside torch's own bfloat16.

The served comparison (``exportlm.engines.serve_and_compare``) states, per engine and
compute dtype, a tolerance on teacher-forced log-probabilities and the largest eager
top-2 margin that the engine's rounding may swap (the engine record's ``tolerances``, ``Engine.tolerance``).
This measures both for a bfloat16 checkpoint on this CPU, so the stated numbers rest on
a measurement anyone can repeat:

- the toy Llama of the engine tests (``initializer_range=0.3``, seed 0) is exported as a
  bfloat16 checkpoint; the reference is the float32 model on the same bf16-rounded
  weights, each sequence alone and unpadded;
- ``--prompts`` seeded prompts (lengths 3, 7, 12 in turn), each followed by the eager
  model's 8 greedy tokens, are scored by vLLM teacher-forced over the whole vocabulary
  (``prompt_logprobs``), and by torch computing the same model in bfloat16 on this CPU
  (an independent bf16 computation: what bf16 rounding alone does here);
- printed for each: the largest |logprob error| of the given prompt tokens (what the
  comparison's tolerance bounds), the largest move of the eager top-2 margin at the
  greedy steps (what decides whether a greedy token may swap), and how many greedy steps
  vLLM's own decoding swapped, with the largest eager margin it swapped.

Nothing is timed; the numbers depend on the CPU's kernels (they are measured, not
derived), so run it on the machine whose numbers you want::

    EXPORTLM_ENGINE_VLLM=.venv-engines/vllm/bin/python \\
        python benchmarks/engine_bf16_error.py [--prompts 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

import exportlm
from exportlm.engines import find_interpreter, get_engine
from exportlm.engines.reference import FIRST_ID, NEW_TOKENS, PROMPT_LENGTHS, eager_reference
from exportlm.models import tiny_hf_model

#: What the vLLM interpreter runs: teacher-forced logprobs over the whole vocabulary,
#: then its own greedy decoding of the prompts. Reads and writes JSON on stdin/stdout.
_VLLM = r"""
import json, os, sys
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from vllm import LLM, SamplingParams
req = json.load(sys.stdin)
llm = LLM(model=req["artifact"], skip_tokenizer_init=True, dtype="bfloat16",
          enforce_eager=True, seed=0, max_logprobs=-1, trust_remote_code=False)
scored = llm.generate([{"prompt_token_ids": s} for s in req["seqs"]],
                      SamplingParams(temperature=0.0, max_tokens=1, detokenize=False,
                                     prompt_logprobs=req["vocab"]), use_tqdm=False)
decoded = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]],
                       SamplingParams(temperature=0.0, max_tokens=req["new_tokens"],
                                      ignore_eos=True, detokenize=False), use_tqdm=False)
out = {
    "version": __import__("vllm").__version__,
    "logprobs": [[{int(k): float(v.logprob) for k, v in step.items()}
                  for step in o.prompt_logprobs[1:]] for o in scored],
    "tokens": [list(o.outputs[0].token_ids) for o in decoded],
}
sys.stdout.write("\n@@RESULT@@" + json.dumps(out))
"""


def _model() -> torch.nn.Module:
    return tiny_hf_model("llama", seed=0, initializer_range=0.3).eval()


def _log_softmax(model: torch.nn.Module, seq: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)[:-1].numpy()  # row i: p(token i+1 | ..i)


def _stats(
    eager: list[np.ndarray],
    other: list[np.ndarray],
    seqs: list[list[int]],
    prompts: list[list[int]],
) -> dict[str, float]:
    given, shift = [], []
    for e, o, seq, prompt in zip(eager, other, seqs, prompts):
        n = len(prompt) - 1  # rows 0..n-1 score prompt tokens 1..n
        tokens = np.array(seq[1:])
        err = np.abs(o[np.arange(len(tokens)), tokens] - e[np.arange(len(tokens)), tokens])
        given.extend(err[:n].tolist())
        for i in range(n, len(tokens)):  # greedy steps: the top-2 margin's move
            a, b = np.argsort(-e[i])[:2]
            shift.append(abs((e[i, a] - e[i, b]) - (o[i, a] - o[i, b])))
    g, s = np.array(given), np.array(shift)
    return {
        "given_max": float(g.max()),
        "given_p99": float(np.percentile(g, 99)),
        "margin_shift_max": float(s.max()),
        "margin_shift_p99": float(np.percentile(s, 99)),
        "positions": float(len(g)),
        "steps": float(len(s)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=30)
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument(
        "--recipe",
        help="quantize first (e.g. w8a8) and export compressed-tensors; the reference is the "
        "fake-quantized model in float32 (no torch bf16 comparison then)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    found = find_interpreter("vllm")
    if found.path is None:
        print(f"vLLM not found: {found.reason} (run `make engines`)", file=sys.stderr)
        return 2

    model = _model()
    if args.recipe:
        from exportlm.quant import quantize

        model = quantize(model, args.recipe)
        eager_model, bf16_model = model, None
    else:
        eager_model = _model()
        with torch.no_grad():
            for p in eager_model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        bf16_model = _model().to(torch.bfloat16)
    vocab = int(model.config.vocab_size)

    rng = np.random.default_rng(args.seed)
    prompts = [
        [int(t) for t in rng.integers(FIRST_ID, vocab, size=PROMPT_LENGTHS[i % 3])]
        for i in range(args.prompts)
    ]
    ref = eager_reference(eager_model, prompts)
    seqs = [p + t for p, t in zip(prompts, ref.tokens)]
    eager = [_log_softmax(eager_model, s) for s in seqs]
    torch_bf16 = None if bf16_model is None else [_log_softmax(bf16_model, s) for s in seqs]

    with tempfile.TemporaryDirectory() as tmp:
        options: dict[str, Any] = (
            {"format": "compressed-tensors"} if args.recipe else {"dtype": "bfloat16"}
        )
        artifact = exportlm.export_model("hf_checkpoint", model, Path(tmp) / "ckpt", **options)
        request = {
            "artifact": str(artifact),
            "seqs": seqs,
            "prompts": prompts,
            "vocab": vocab,
            "new_tokens": NEW_TOKENS,
        }
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env.update(get_engine("vllm").env)  # as the served comparison runs it
        proc = subprocess.run(
            [str(found.path), "-E", "-s", "-c", _VLLM],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            env=env,
        )
    if proc.returncode != 0 or "@@RESULT@@" not in proc.stdout:
        print(proc.stderr[-4000:], file=sys.stderr)
        return 1
    got = json.loads(proc.stdout.rsplit("@@RESULT@@", 1)[1])
    vllm = []
    for rows in got["logprobs"]:
        m = np.full((len(rows), vocab), np.nan)
        for i, step in enumerate(rows):
            for k, v in step.items():
                m[i, int(k)] = v
        vllm.append(m)

    swaps = [
        (ref.margins[r][i], r, i)
        for r, (g, w) in enumerate(zip(got["tokens"], ref.tokens))
        for i, (a, b) in enumerate(zip(g, w))
        if a != b and all(x == y for x, y in zip(g[:i], w[:i]))  # the first divergence of the row
    ]
    result: dict[str, Any] = {
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "vllm": got["version"],
        "prompts": args.prompts,
        "eager_min_margin": ref.min_margin,
        "vllm_bf16": _stats(eager, vllm, seqs, prompts),
        "recipe": args.recipe,
        "torch_bf16": None if torch_bf16 is None else _stats(eager, torch_bf16, seqs, prompts),
        "vllm_rows_diverged": len(swaps),
        "vllm_largest_swapped_margin": max((s[0] for s in swaps), default=0.0),
    }
    what = f"{args.recipe} compressed-tensors" if args.recipe else "plain bfloat16 checkpoint"
    print(f"{what}: {args.prompts} prompts x {NEW_TOKENS} greedy tokens; vLLM {got['version']}")
    print(f"{'':12} {'given max':>10} {'given p99':>10} {'shift max':>10} {'shift p99':>10}")
    for name in ("vllm_bf16", "torch_bf16"):
        s = result[name]
        if s is None:
            continue
        print(
            f"{name:12} {s['given_max']:10.3f} {s['given_p99']:10.3f} "
            f"{s['margin_shift_max']:10.3f} {s['margin_shift_p99']:10.3f}"
        )
    print(
        f"vLLM's greedy rows that diverged: {len(swaps)} of {args.prompts}; largest eager "
        f"margin swapped {result['vllm_largest_swapped_margin']:.3f}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
