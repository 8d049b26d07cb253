"""INT4 AWQ: our checkpoint against NVIDIA ModelOpt's, layer by layer.

Quantizes the same tiny transformers models (Llama untied / tied / MHA, hidden
128; Mixtral; Qwen3-MoE) with the same calibration batch, by ``exportlm.quant.quantize``
(``"int4_awq"``) and by ModelOpt's ``INT4_AWQ_CFG`` (``awq_lite``), exports both with
their ``hf_checkpoint`` exporters and reads the checkpoints back. For every quantized
linear it prints the relative reconstruction error of the effective weight,
``||W_eff - W|| / ||W||`` with ``W_eff = dequant(weight) * pre_quant_scale`` (the scale
either written as ``pre_quant_scale`` or folded into the preceding norm, recovered as
folded norm weight / original norm weight), and per model the relative logits error
against the unquantized model (checkpoints loaded by the ``hf_checkpoint`` runtime).
ModelOpt cannot quantize transformers-5 fused experts with AWQ; its column then says why.
Before each table, one line says how many of our linear groups took the joint search's
scale and how many ModelOpt's average of per-linear scales (``exportlm.quant._awq``'s
rule: the joint scale only where no member's weight error is worse).

Usage: ``python benchmarks/awq_vs_modelopt.py [family ...]`` (needs ``nvidia-modelopt``).
"""

from __future__ import annotations

import copy
import logging
import re
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

import exportlm
from exportlm.models import tiny_hf_model
from exportlm.quant import quantize
from exportlm.quant._formats import dequantize
from exportlm.quant.formats import get_format

FAMILIES = ("llama", "llama_tied", "llama_mha", "mixtral", "qwen3_moe")
_NORM_OF = {
    "q_proj": "input_layernorm",
    "k_proj": "input_layernorm",
    "v_proj": "input_layernorm",
    "gate_proj": "post_attention_layernorm",
    "up_proj": "post_attention_layernorm",
}


def _model(family: str) -> torch.nn.Module:
    overrides = {"num_key_value_heads": 4} if family == "llama_mha" else {}
    model = tiny_hf_model(family.removesuffix("_mha"), seed=0, **overrides).eval()
    model.config.architectures = [type(model).__name__]
    return model


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _effective(
    tensors: dict[str, torch.Tensor], name: str, norms: dict[str, torch.Tensor]
) -> torch.Tensor:
    spec = get_format("int4")
    leaves = {
        leaf.name: tensors[f"{name}.{leaf.name}"]
        for leaf in spec.weight_leaves
        if f"{name}.{leaf.name}" in tensors
    }
    weight = dequantize(spec.from_leaves(leaves), torch.float32)
    pqs = tensors.get(f"{name}.pre_quant_scale")
    if pqs is not None:
        weight = weight * pqs.float().reshape(1, -1)
    leaf = name.rsplit(".", 1)[-1]
    if leaf in _NORM_OF and "experts" not in name:
        norm = f"{name.rsplit('.', 2)[0]}.{_NORM_OF[leaf]}.weight"
        weight = weight * (tensors[norm].float() / norms[norm].float()).reshape(1, -1)
    return weight


def _errors(directory: Path, original: dict[str, torch.Tensor]) -> dict[str, float]:
    tensors = _tensors(directory)
    out = {}
    for key in sorted(tensors):
        if key.endswith(".weight_scale"):
            name = key.removesuffix(".weight_scale")
            ref = original.get(f"{name}.weight")
            if ref is None:
                continue
            eff = _effective(tensors, name, original)
            out[name] = float((eff - ref.float()).norm() / ref.float().norm())
    return out


def _logits_error(directory: Path, reference: torch.nn.Module, batch: torch.Tensor) -> float:
    run = exportlm.load_exported("hf_checkpoint", directory, trust=True)
    with torch.no_grad():
        want = reference(batch).logits.float()
        got = run(batch).float()
    return float((got - want).norm() / want.norm())


#: Checkpoint names of the per-expert projections where a family renames them
#: (Mixtral's checkpoints keep the transformers-4 ``block_sparse_moe.experts.{e}.w1/w2/w3``).
_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}),
}


def _per_expert_originals(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Original weights under the checkpoint's per-expert names (fused experts split)."""
    out = dict(model.state_dict())
    block, names = _EXPERT_NAMES.get(str(model.config.model_type), (None, {}))
    for key, value in list(out.items()):
        match = re.fullmatch(r"(.*)\.(\w+)\.experts\.(gate_up_proj|down_proj)", key)
        if match is None or value.dim() != 3:
            continue
        layer, parent, proj = match.groups()
        prefix = f"{layer}.{block or parent}.experts"
        for e in range(value.shape[0]):
            parts = {"down_proj": value[e]}
            if proj == "gate_up_proj":
                gate, up = value[e].chunk(2, dim=0)
                parts = {"gate_proj": gate, "up_proj": up}
            for name, weight in parts.items():
                out[f"{prefix}.{e}.{names.get(name, name)}.weight"] = weight
    return out


class _ChoiceCounter(logging.Handler):
    """Keeps the last "AWQ scales of N linear group(s): ..." line of ``quantize``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.line = ""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("AWQ scales of"):
            self.line = message


def compare(family: str, workdir: Path) -> list[tuple[str, float, float | None]]:
    """``[(layer, ours, modelopt or None)]`` plus a ``("logits", ...)`` row."""
    model = _model(family)
    batch = torch.randint(
        0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    original = _per_expert_originals(model)

    def calibrate(m: Any) -> None:
        with torch.no_grad():
            m(batch)

    counter = _ChoiceCounter()
    awq_logger = logging.getLogger("exportlm.quant._awq")
    awq_logger.addHandler(counter)
    awq_logger.setLevel(logging.INFO)
    try:
        ours = quantize(copy.deepcopy(model), "int4_awq", calibrate=calibrate)
    finally:
        awq_logger.removeHandler(counter)
    print(f"{family}: {counter.line}")
    ours_dir = exportlm.export_model("hf_checkpoint", ours, workdir / f"{family}-ours")
    ours_err = _errors(ours_dir, original)
    theirs_err: dict[str, float] = {}
    theirs_logits: float | None = None
    try:
        import modelopt.torch.export as mte
        import modelopt.torch.quantization as mtq

        theirs = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mtq.quantize(theirs, mtq.INT4_AWQ_CFG, forward_loop=calibrate)
            mte.export_hf_checkpoint(theirs, export_dir=workdir / f"{family}-modelopt")
        theirs_err = _errors(workdir / f"{family}-modelopt", original)
        theirs_logits = _logits_error(workdir / f"{family}-modelopt", model, batch)
    except Exception as err:
        print(f"{family}: ModelOpt failed: {type(err).__name__}: {str(err)[:100]}")
    rows: list[tuple[str, float, float | None]] = [
        (name, err, theirs_err.get(name)) for name, err in ours_err.items()
    ]
    rows.append(("logits", _logits_error(ours_dir, model, batch), theirs_logits))
    return rows


def main(families: list[str]) -> None:
    """Print the table of both sides per layer."""
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            rows = compare(family, Path(tmp))
            print(f"{family:<44} {'ours':>9} {'modelopt':>9}  ours<=modelopt")
            for name, ours, theirs in rows:
                ref = "n/a" if theirs is None else f"{theirs:9.5f}"
                ok = (
                    ""
                    if theirs is None
                    else ("yes" if ours <= theirs * (1 + 1e-4) + 1e-7 else "NO")
                )
                print(f"  {name:<42} {ours:9.5f} {ref:>9}  {ok}")
            print()


if __name__ == "__main__":
    main(sys.argv[1:] or list(FAMILIES))
