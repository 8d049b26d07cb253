"""llm-compressor's own GPTQ on one saved weight and Hessian (run in its own venv).

``python _llmc_gptq_worker.py IN OUT``: ``IN`` is a ``torch.save`` of a list of jobs
``{"weight": [out, in], "hessian": [in, in], "scale": [out, in / group], "group_size": int,
"actorder": "none" | "weight", "dampening": float}``; for each the worker runs
``llmcompressor.modifiers.gptq.gptq_quantize.quantize_weight`` (its eager torch block
update: no GPU here) with those group scales, symmetric INT4 (``QuantizationArgs`` with
``strategy="group"``), and saves the list of ``{"weight": the dequantized result, "fallback": bool}`` to ``OUT``. It
imports nothing from this repository (llm-compressor's pins conflict with ours).
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def main(source: str, out: str) -> None:
    jobs = torch.load(source, weights_only=True)
    torch.save([_run(job) for job in jobs], out)


def _run(job: dict[str, Any]) -> dict[str, Any]:
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight

    actorder = None if job["actorder"] == "none" else "weight"
    args = QuantizationArgs(
        num_bits=4,
        type="int",
        symmetric=True,
        strategy="group",
        group_size=int(job["group_size"]),
        actorder=actorder,
    )
    scale = job["scale"][None]
    quantized, _, fallback = quantize_weight(
        job["weight"][None].float(),
        job["hessian"][None].float(),
        scale,
        torch.zeros_like(scale, dtype=torch.int8),
        None,
        args,
        blocksize=128,
        percdamp=float(job["dampening"]),
    )
    return {"weight": quantized[0], "fallback": bool(fallback[0])}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
