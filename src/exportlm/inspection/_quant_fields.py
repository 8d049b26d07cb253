"""Fields of a quantization declaration that the loaders require in one form.

* A ModelOpt ``group_size`` (``hf_quant_config.json`` ``quantization``, ``config.json``
  ``quantization_config``, each ``quantized_layers`` entry), where written and not
  ``null``, is a positive int: the loaders size the block scales by it (vLLM 0.32's NVFP4
  divides the input features by it, ``modelopt.py``), and ModelOpt writes it only from a
  non-zero block size (``modelopt/torch/export/quant_utils.py``).
* ModelOpt's ``kv_cache_quant_algo``, where written, is one of the KV-cache algorithms
  ModelOpt writes (``FP8``, ``INT8``, ``NVFP4``, ``NVFP4_AFFINE``: ``model_config.py``'s
  ``KV_CACHE_*``) or a registered format's, as written: exportlm's loader and TensorRT-LLM's
  enum take the names as written (vLLM upper-cases it and refuses a non-string).
* The lists of module names (``exclude_modules``; ``ignore``; a compressed-tensors group's
  ``targets``) are JSON lists of strings: vLLM's ModelOpt config raises
  ``exclude_modules must be a list``, and compressed-tensors' pydantic models take
  ``list[str]`` (``targets`` required).
"""

from __future__ import annotations

from typing import Any

from exportlm.checkpoint import Section
from exportlm.inspection._declared import _group_size

__all__ = ["group_size_problem", "kv_algo_problem", "list_problems"]

#: The KV-cache algorithms ModelOpt writes (0.47 ``modelopt/torch/export/model_config.py``).
MODELOPT_KV_ALGOS = frozenset({"FP8", "INT8", "NVFP4", "NVFP4_AFFINE"})

Problem = tuple[str, str, str]


def group_size_problem(size: Any, where: str, subject: str) -> Problem | None:
    """A ModelOpt ``group_size`` that is written and not a positive int."""
    if size is None or _group_size(size) is not None:
        return None
    return (
        "config-field-invalid",
        subject,
        f"{where} group_size is {size!r}, expected a positive int: the loaders size the "
        "weights' block scales by it (vLLM's NVFP4 divides the input features by it)",
    )


def kv_algo_problem(algo: Any, where: str, subject: str) -> Problem | None:
    """A ModelOpt ``kv_cache_quant_algo`` no loader or registered format knows."""
    known = _kv_algos()
    if algo is None or (isinstance(algo, str) and algo in known):
        return None
    return (
        "quant-algo-unknown",
        subject,
        f"{where} kv_cache_quant_algo is {algo!r}, which is no KV-cache algorithm ModelOpt "
        f"writes or a registered format declares ({', '.join(sorted(known))}), as written: "
        "TensorRT-LLM's QuantAlgo enum and exportlm's loader refuse it (vLLM upper-cases "
        "the name and refuses a non-string)",
    )


def _kv_algos() -> frozenset[str]:
    from exportlm.quant.formats import formats

    return MODELOPT_KV_ALGOS | {s.kv_cache.quant_algo for s in formats() if s.kv_cache is not None}


def list_problems(section: Section) -> list[Problem]:
    """``config-field-invalid`` for each list of module names that is not a list of strings."""
    why = (
        "compressed-tensors' config models take list[str], and a group's targets are required"
        if section.layout == "compressed-tensors"
        else "vLLM's ModelOpt config raises 'exclude_modules must be a list' and matches "
        "each entry as a string"
    )
    return [
        (
            "config-field-invalid",
            section.file,
            f"{key} is {value!r}, expected a JSON list of module-name strings: {why}",
        )
        for key, value in section.lists_invalid
    ]
