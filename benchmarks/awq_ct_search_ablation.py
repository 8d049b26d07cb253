"""Ablations of the compressed-tensors AWQ search on SmolLM2-135M, outside the library.

llm-compressor 0.14's AWQ re-implemented on the float model: its Llama mappings
(``input_layernorm -> q/k/v``, ``post_attention_layernorm -> gate/up``, ``up -> down``;
``v -> o`` skipped under grouped-query attention, ``o_proj`` round-to-nearest), its activation
and weight statistics, its scale normalisation, and compressed-tensors' symmetric INT4 group-64
quantizer (``amax / 7.5`` in bf16, the quotient in bf16, codes in [-8, 7]) both in the search and
in the final round-to-nearest. Only the loss and the grid are switched, so each is measured alone:

``LOSS``: ``parent`` (llm-compressor's: the output of the whole attention / MLP block),
``own`` (ours: the sum of the members' own squared output errors), ``rtn`` (no AWQ).
``GRID``: ``llmc`` (``n_grid=20``, ``duo_scaling``: the identity and ratios i/18), ``mo``
(ModelOpt's alpha 0, 0.1, ..., 1 with its clamp).

Every layer's search reads the float model's activations (llm-compressor's sequential
pipeline propagates the smoothed, unquantized layers: its pipeline runs under
``DisableQuantization``). Usage, from the repository root, with a ``quality.py`` run's data
(``run.pt``: calibration batches and evaluation ids)::

    python benchmarks/awq_ct_search_ablation.py LOSS GRID ROWS RUN.pt

Prints the chosen ratios per layer (q/k/v, gate/up, down) and the perplexity on the run's
evaluation windows (``_quality_metrics.perplexity``).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests._real_model
from _quality_metrics import hf_logits, perplexity

GROUP = 64
KWARGS = ("attention_mask", "position_embeddings", "position_ids", "cache_position")


def qct(w: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' symmetric INT4 fake quantization in groups of 64, in bf16."""
    w = w.to(torch.bfloat16)
    g = w.reshape(w.shape[0], -1, GROUP)
    scale = g.abs().amax(-1, keepdim=True) / torch.tensor(7.5, dtype=torch.bfloat16)
    scale = torch.where(scale == 0, torch.finfo(torch.bfloat16).eps, scale)
    q = torch.round(g / scale).clamp(-8, 7)
    return (q.to(torch.bfloat16) * scale).reshape(w.shape)


def weight_mean(weights: list[torch.Tensor]) -> torch.Tensor:
    """llm-compressor's ``_compute_layer_means``: |W| over its group's amax, row mean."""
    total: torch.Tensor | float = 0.0
    rows = 0
    for w in weights:
        x = w.clone().reshape(-1, GROUP).abs()
        x = (x / (x.amax(1, keepdim=True) + 1e-6)).reshape(w.shape)
        total = total + x.sum(0, dtype=torch.float64)
        rows += w.shape[0]
    return (torch.as_tensor(total) / rows).float()


def candidates(grid: str, xm: torch.Tensor, wm: torch.Tensor) -> list[tuple[float, torch.Tensor]]:
    out = []
    if grid == "llmc":
        for r, duo in [(0.0, False)] + [(i / 18, True) for i in range(19)]:
            s = (xm.pow(r) / (wm.pow(1 - r) + 1e-4)) if duo else xm.pow(r)
            s = s.clamp(min=1e-4)
            out.append((r, s / (s.max() * s.min()).sqrt()))
    else:
        for i in range(11):
            a = i / 10
            s = (xm.double().pow(a) / (wm.double().pow(1 - a) + 1e-38)).clamp(1e-4, 1e4)
            out.append((a, (s / (s.max() * s.min()).sqrt()).float()))
    return out


def search(
    loss_kind: str,
    grid: str,
    linears: list[torch.nn.Linear],
    x: torch.Tensor,
    parent: Callable[[], torch.Tensor] | None,
    reference: torch.Tensor,
) -> tuple[float, torch.Tensor]:
    """The best ``(ratio, scale)``; ``parent=None``: the members' own outputs (a Gram form)."""
    originals = [lin.weight.data.clone() for lin in linears]
    xm = x.abs().float().reshape(-1, x.shape[-1]).mean(0)
    gram = None
    if loss_kind == "own" or parent is None:
        rows = x.reshape(-1, x.shape[-1]).double()
        gram = rows.T @ rows
    best: tuple[float, float, torch.Tensor | None] = (math.inf, 0.0, None)
    for r, s in candidates(grid, xm, weight_mean(originals)):
        if gram is not None:
            loss = 0.0
            for w0 in originals:
                d = (qct(w0 * s) / s).to(torch.bfloat16).double() - w0.double()
                loss += float(((d @ gram) * d).sum())
        else:
            for lin, w0 in zip(linears, originals, strict=True):
                lin.weight.data = (qct(w0 * s) / s).to(torch.bfloat16)
            assert parent is not None
            loss = float((parent().float() - reference.float()).pow(2).mean())
        if loss < best[0]:
            best = (loss, r, s)
    for lin, w0 in zip(linears, originals, strict=True):
        lin.weight.data = w0
    assert best[2] is not None
    return best[1], best[2]


def smooth_layer(layer: Any, h: torch.Tensor, kw: dict[str, Any], loss: str, grid: str) -> str:
    attn, mlp = layer.self_attn, layer.mlp
    x1 = layer.input_layernorm(h)
    a_ref = attn(hidden_states=x1, **kw)[0]
    x2 = layer.post_attention_layernorm(h + a_ref)
    x3 = mlp.act_fn(mlp.gate_proj(x2)) * mlp.up_proj(x2)
    qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
    r1, s1 = search(loss, grid, qkv, x1, lambda: attn(hidden_states=x1, **kw)[0], a_ref)
    r2, s2 = search(loss, grid, [mlp.gate_proj, mlp.up_proj], x2, lambda: mlp(x2), mlp(x2))
    r3, s3 = search(loss, grid, [mlp.down_proj], x3, None, mlp.down_proj(x3))
    for s, norm, linears in (
        (s1, layer.input_layernorm, qkv),
        (s2, layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj]),
    ):
        norm.weight.data = (norm.weight.data / s).to(torch.bfloat16)
        for lin in linears:
            lin.weight.data = (lin.weight.data * s.view(1, -1)).to(torch.bfloat16)
    mlp.up_proj.weight.data = (mlp.up_proj.weight.data / s3.view(-1, 1)).to(torch.bfloat16)
    mlp.down_proj.weight.data = (mlp.down_proj.weight.data * s3.view(1, -1)).to(torch.bfloat16)
    return f"{r1:.3f} {r2:.3f} {r3:.3f}"


@torch.no_grad()
def main() -> None:
    from tests._real_model import real_model_dir

    loss, grid, rows, run = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    data = torch.load(run, weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(real_model_dir(), dtype=torch.bfloat16).eval()
    inputs: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}

    def keep(i: int) -> Callable[..., None]:
        def hook(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            h = args[0] if args else kwargs["hidden_states"]
            inputs.setdefault(i, (h, {k: v for k, v in kwargs.items() if k in KWARGS}))

        return hook

    layers = model.model.layers
    handles = [
        layer.register_forward_pre_hook(keep(i), with_kwargs=True) for i, layer in enumerate(layers)
    ]
    model(torch.cat(data["batches"])[:rows], use_cache=False)
    for handle in handles:
        handle.remove()
    start = time.time()
    if loss != "rtn":
        for i, layer in enumerate(layers):
            chosen = smooth_layer(layer, *inputs[i], loss, grid)
            print(i, chosen, f"{time.time() - start:.0f}s", flush=True)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "lm_head" not in name:
            module.weight.data = qct(module.weight.data)
    ppl = perplexity(hf_logits(model), data["eval_ids"], data["window"])
    print("ppl", loss, grid, rows, ppl, flush=True)


if __name__ == "__main__":
    main()
