"""The quantized checkpoints the ``served`` check serves beside the plain one, on the CPU
and on a CUDA device (:mod:`pytest_exportcheck.checks.targets.served`)."""

from __future__ import annotations

from typing import NamedTuple

from pytest_exportcheck.checks._api import CheckResult
from pytest_exportcheck.checks._common import CheckAbort

__all__ = ["QUANTIZED", "QUANTIZED_CUDA", "Quantized", "require_capability"]


class Quantized(NamedTuple):
    """One quantized checkpoint served besides the plain one."""

    layout: str  # the checkpoint format (the tables' layout)
    recipe: str
    scheme: str  # the scheme the tables name it by
    #: modules left unquantized: compressed-tensors has no ``pre_quant_scale`` tensor, so
    #: AWQ's scales must fold into the norm feeding the layer (o_proj / down_proj have none)
    exclude: tuple[str, ...] = ()
    #: the only CUDA compute capability the engine runs the scheme on (``None``: any it
    #: supports); on another GPU the artifact is skipped, naming both
    capability: tuple[int, int] | None = None


#: The quantized checkpoints served on the CPU: CT FP8 (transformers; vLLM's CPU build
#: confirms its engine limit), ModelOpt W8A16 (vLLM confirms its refusal), and the
#: compressed-tensors integer layouts vLLM's CPU build runs: W8A8 (int8 weights, dynamic
#: per-token int8 inputs) and W4A16 (AWQ, pack-quantized uint4b8, group 128: the toy
#: families' Linear in-features, 128 and 256, are multiples of the group), every linear and
#: expert quantized in compressed-tensors' convention (the AWQ scales no norm takes fold
#: into the op before: v -> o where the heads allow, up -> down, per expert).
QUANTIZED: tuple[Quantized, ...] = (
    Quantized("compressed-tensors", "fp8", "FP8"),
    Quantized("modelopt", "int8_wo", "W8A16"),
    Quantized("compressed-tensors", "w8a8", "W8A8"),
    Quantized("compressed-tensors", "int4_awq:scales=compressed-tensors", "W4A16"),
)
#: On a CUDA device, instead: vLLM's GPU-only FP8 / NVFP4 / FP8-block / MX paths, computed
#: in bfloat16 (vLLM 0.32's ModelOpt configs take bfloat16 / float16 activations only:
#: vllm/model_executor/layers/quantization/modelopt.py, get_supported_act_dtypes). FP8
#: blocks of 32: the toy's k/v projections have 64 outputs, and vLLM checks every merged
#: partition but the last against the block (fp8_utils.py validate_fp8_block_shape).
QUANTIZED_CUDA: tuple[Quantized, ...] = (
    Quantized("modelopt", "fp8", "FP8"),
    Quantized("compressed-tensors", "fp8", "FP8"),
    Quantized("modelopt", "nvfp4", "NVFP4"),
    Quantized("compressed-tensors", "fp8_block:group_size=32", "FP8_BLOCK"),
    Quantized("modelopt", "mxfp8", "MXFP8"),
    Quantized("compressed-tensors", "mxfp4", "MXFP4A16"),
    # Hopper only (compressed_tensors.py _is_fp8_w4a8_sm90: capability 90, match_exact);
    # CUTLASS W4A8 takes groups of 128 and a merged partition's 128-divisible sum
    # (kernels/linear/mixed_precision/cutlass.py can_implement): the toy's q/k/v 256
    Quantized("compressed-tensors", "w4afp8", "W4AFP8", capability=(9, 0)),
)


def require_capability(device: str, q: Quantized) -> None:
    """A skip naming both capabilities where the engine runs ``q`` on another GPU only."""
    if q.capability is None or not device.startswith("cuda"):
        return
    import torch

    found = tuple(torch.cuda.get_device_capability(torch.device(device)))
    if found != q.capability:
        raise CheckAbort(
            CheckResult.skipped(
                f"{q.layout} {q.scheme}: the engine runs it on compute capability "
                f"{q.capability[0]}.{q.capability[1]} only; this GPU is {found[0]}.{found[1]}"
            )
        )
