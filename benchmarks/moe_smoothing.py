"""Compressed-tensors INT4 AWQ on toy MoE models: the MoE block's input scale against none.

For each family, the seeded toy model (``exportlm.models.tiny_hf_model(family, seed=0)``)
is quantized with ``int4_awq`` in the compressed-tensors convention on 8 x 64 random tokens
(seed 1), with the experts' ``gate_up`` round-to-nearest (the norm keeps its weight) and with
the block's input smoothed (docs/checkpoint-format.md, "The MoE block's input: one AWQ scale
in the norm"); printed: the MSE of the logits against the float model on another 8 x 64
tokens (seed 2), and with ``--llmcompressor`` llm-compressor's own ``AWQModifier`` W4A16
(its default MoE mappings, the router and ``lm_head`` ignored) on the same model and tokens,
run in its venv (``tests/_peers.py``).

    python benchmarks/moe_smoothing.py [--llmcompressor] [FAMILY ...]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss")

#: Run by llm-compressor's interpreter: ``argv``: model directory, tensors file.
_LLMC = """
import sys, torch
torch.Tensor.pin_memory = lambda self, *a, **k: self  # no CUDA: llm-compressor pins its cache
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.awq import AWQModifier
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
data = torch.load(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
rows = data["calib"].tolist()
ds = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
words = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
recipe = [AWQModifier(targets=["Linear"], scheme="W4A16",
                      ignore=["lm_head", "re:.*mlp.gate$", "re:.*mlp.router$"])]
oneshot(model=model, processor=PreTrainedTokenizerFast(tokenizer_object=words), recipe=recipe,
        dataset=ds, num_calibration_samples=len(rows), shuffle_calibration_samples=False,
        batch_size=len(rows), pipeline="basic")
with torch.no_grad():
    print(float((model(data["eval"]).logits - data["float"]).pow(2).mean()))
"""


def _ours(family: str, smooth: bool, calib: torch.Tensor, held_out: torch.Tensor) -> float:
    import exportlm.quant._calibration_steps as steps
    from exportlm.models import tiny_hf_model
    from exportlm.quant import QuantRecipe, quantize

    model = tiny_hf_model(family, seed=0).eval()
    reference = tiny_hf_model(family, seed=0).eval()
    kept = steps.smooth_moe_inputs
    if not smooth:
        steps.smooth_moe_inputs = lambda *a, **k: 0  # type: ignore[assignment]
    try:
        recipe = QuantRecipe.parse("int4_awq").for_layout("compressed-tensors")
        quantize(model, recipe, calibrate=lambda m: m(calib))
    finally:
        steps.smooth_moe_inputs = kept
    with torch.no_grad():
        return float((model(held_out).logits - reference(held_out).logits).pow(2).mean())


def _llmcompressor(family: str, calib: torch.Tensor, held_out: torch.Tensor) -> float:
    from exportlm.models import tiny_hf_model
    from tests._peers import llmcompressor_python

    model = tiny_hf_model(family, seed=0).eval()
    with tempfile.TemporaryDirectory() as scratch, torch.no_grad():
        model.save_pretrained(Path(scratch) / "model")
        data = {"calib": calib, "eval": held_out, "float": model(held_out).logits}
        torch.save(data, Path(scratch) / "data.pt")
        done = subprocess.run(
            [str(llmcompressor_python()), "-c", _LLMC, f"{scratch}/model", f"{scratch}/data.pt"],
            capture_output=True,
            text=True,
            check=True,
        )
    return float(done.stdout.strip().splitlines()[-1])


def main(families: list[str], peer: bool) -> None:
    from exportlm.models import tiny_hf_model

    print("| family | round-to-nearest gate_up | smoothed | ratio | llm-compressor AWQ |")
    print("| --- | --- | --- | --- | --- |")
    for family in families:
        vocab = tiny_hf_model(family, seed=0).config.vocab_size
        calib = torch.randint(0, vocab, (8, 64), generator=torch.Generator().manual_seed(1))
        held_out = torch.randint(0, vocab, (8, 64), generator=torch.Generator().manual_seed(2))
        rtn = _ours(family, False, calib, held_out)
        smoothed = _ours(family, True, calib, held_out)
        theirs = f"{_llmcompressor(family, calib, held_out):.4g}" if peer else "-"
        print(f"| {family} | {rtn:.4g} | {smoothed:.4g} | {smoothed / rtn:.3f} | {theirs} |")


if __name__ == "__main__":
    args = sys.argv[1:]
    main([a for a in args if not a.startswith("--")] or list(FAMILIES), "--llmcompressor" in args)
