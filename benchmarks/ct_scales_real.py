"""How far a compressed-tensors checkpoint of SmolLM2-135M (bf16) is from its fake-quant model.

For each recipe, the real model (``tests/_real_model.py``) is calibrated on 2 x 64 random
tokens, exported with ``format="compressed-tensors"``, and read back by our loader and by
transformers in the engines' venv (``EXPORTLM_ENGINE_TRANSFORMERS``, ``make engines``);
printed: the max |logit diff| of each against the fake-quantized model on those tokens.
The ModelOpt scale convention (``fp8``, ``nvfp4``) against ``scales=compressed-tensors``
(docs/checkpoint-format.md, "The compressed-tensors scale convention").

    python benchmarks/ct_scales_real.py [RECIPE ...]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

RECIPES = ("fp8", "fp8:scales=compressed-tensors", "nvfp4", "nvfp4:scales=compressed-tensors")


def main(recipes: list[str]) -> None:
    from transformers import AutoModelForCausalLM

    import exportlm
    from exportlm.engines import find_interpreter
    from exportlm.quant import quantize
    from tests._peers import transformers_logits
    from tests._real_model import real_model_dir

    python = find_interpreter("transformers").path
    for recipe in recipes:
        model = AutoModelForCausalLM.from_pretrained(
            real_model_dir(), dtype=torch.bfloat16, attn_implementation="eager"
        ).eval()
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, model.config.vocab_size, (2, 64), generator=gen)
        quantize(model, recipe, calibrate=lambda m, ids=ids: m(ids))
        work = Path(tempfile.mkdtemp())
        out = exportlm.export_model(
            "hf_checkpoint", model, work / "ct", format="compressed-tensors"
        )
        with torch.no_grad():
            want = model(ids).logits.float()
            ours = exportlm.load_exported("hf_checkpoint", out)(ids).float()
        line = f"{recipe}: our loader {float((ours - want).abs().max()):.4g}"
        if python is not None:
            theirs = transformers_logits(python, out, ids, work)
            agree = float((theirs.argmax(-1) == want.argmax(-1)).float().mean())
            line += f", transformers {float((theirs - want).abs().max()):.4g} (argmax {agree:.1%})"
        print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(RECIPES))
