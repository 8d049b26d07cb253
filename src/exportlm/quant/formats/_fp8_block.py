"""FP8 block-wise weights, per-group dynamic FP8 inputs (``fp8_block``).

``weight`` float8_e4m3fn ``[out, in]`` with one float32 scale per ``b x b`` tile
(``b`` = the block size, 128 by default: DeepSeek-V3's and Qwen3-FP8's ``[128, 128]``),
``weight_scale [ceil(out / b), in / b]`` = the tile's ``amax / 448`` (a zero tile gets
1.0). The output rows need not fill the last tile (its scale covers the rows there
are, as compressed-tensors' ``ceil``); the input features must be a multiple of
``b``: the inputs are quantized in groups of ``b`` along the same dimension at run
time (``fp8_group``: each token's group of ``b`` features with its own
``amax / 448``, no calibration, no stored ``input_scale``), and a partial group is a
kernel no engine ships (vLLM's block GEMM asserts ``in % b == 0``), so such a
weight is refused with the block sizes that fit instead of padded.

It is compressed-tensors' / llm-compressor's ``FP8_BLOCK`` preset
(``float-quantized``; weights ``strategy: block, block_structure: [b, b]``; inputs
``strategy: group, group_size: b, dynamic: true``), whose ``weight_scale`` has this
very shape. In the ModelOpt layout it is ModelOpt 0.47's ``FP8_PB_WO`` (``quant_algo:
"fp8_pb_wo"``, what its ``FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG`` exports: ``export/quant_utils.py``),
the same codes with the scales ``[ceil(out / b), 1, in / b, 1]``; its config records no block
size and vLLM 0.32 reads 128 x 128 tiles, so that layout holds blocks of 128 only. ModelOpt's
own model leaves the inputs in float ("weight only"), but vLLM serves ``FP8_PB_WO`` with
inputs quantized per token and group of 128 at run time (``modelopt.py`` ``resolve``:
``kFp8Dynamic128Sym``): this format's model, which our loader runs too.

It is also the layout DeepSeek-V3 / Qwen3-FP8 checkpoints ship (``format="finegrained-fp8"``,
:class:`~exportlm.quant.formats.FineGrainedFP8Scheme`): ``quant_method: "fp8"`` with
``weight_block_size: [b, b]``, the same codes, and the same scales stored as
``weight_scale_inv`` (transformers' and vLLM's name for the dequantization multiplier).
"""

from __future__ import annotations

import math

import torch

from exportlm.quant._tensor import FP8_MAX, QuantizedTensor, safe_scale
from exportlm.quant.formats._parts import (
    CompressedTensorsScheme,
    FineGrainedFP8Scheme,
    Leaf,
    LeafCodec,
    LeafTensors,
    ModelOptScheme,
    StoredLeaf,
)
from exportlm.quant.formats._spec import FormatSpec

__all__ = ["FP8_BLOCK", "FP8_GROUP"]

_NAME = "fp8_block"
_INPUTS = "fp8_group"
#: The block edge when a recipe or checkpoint names none (``block_structure: [128, 128]``).
DEFAULT_BLOCK = 128

#: compressed-tensors' ``FP8_BLOCK`` preset (``quantization/quant_scheme.py``); the
#: writer sets ``block_structure`` and the inputs' ``group_size`` to the layer's block.
_CT_WEIGHTS = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "strategy": "block",
    "dynamic": False,
    "block_structure": [DEFAULT_BLOCK, DEFAULT_BLOCK],
}
_CT_INPUTS = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "strategy": "group",
    "dynamic": True,
    "group_size": DEFAULT_BLOCK,
}


def _need_block(x: torch.Tensor, block_size: int | None, where: str) -> int:
    if not block_size:
        raise ValueError(f"{where}: FP8 block quantization needs a block_size")
    if x.shape[-1] % block_size:
        raise ValueError(
            f"{where}: {x.shape[-1]} input features are not a multiple of the FP8 block "
            f"{block_size}; quantize with a group_size that divides them, or exclude the module"
        )
    return block_size


def quantize_fp8_tiles(
    x: torch.Tensor, *, scale: torch.Tensor | None, block_size: int | None, where: str
) -> QuantizedTensor:
    """``x`` (``[..., out, in]``) to float8_e4m3fn with one ``amax / 448`` per ``b x b`` tile.

    ``scale`` is unused (every scale comes from ``x``); leading dimensions (stacked
    experts) are tiled each on their own. The last row tile may be partial.
    """
    b = _need_block(x, block_size, where)
    x32 = x.detach().to(torch.float32)
    *lead, rows, cols = x32.shape
    tiles_r = -(-rows // b)
    padded = torch.nn.functional.pad(x32, (0, 0, 0, tiles_r * b - rows))
    tiles = padded.reshape(*lead, tiles_r, b, cols // b, b)
    scales = safe_scale(tiles.abs().amax(dim=(-3, -1)), FP8_MAX, where=where)
    scaled = (tiles / scales[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    codes = scaled.to(torch.float8_e4m3fn).reshape(padded.shape)[..., :rows, :].contiguous()
    return QuantizedTensor(_NAME, codes, scales, None, b, tuple(x.shape), x.dtype)


def expand_tiles(scales: torch.Tensor, rows: int, block: int) -> torch.Tensor:
    """Tile scales ``[..., ceil(rows / b), in / b]`` as one value per element ``[..., rows, in]``."""
    per_row = scales.repeat_interleave(block, dim=-2)[..., :rows, :]
    return per_row.repeat_interleave(block, dim=-1)


def dequantize_fp8_tiles(q: QuantizedTensor) -> torch.Tensor:
    """``codes * tile scale`` in float32."""
    if q.block_size is None:
        raise ValueError("an fp8_block QuantizedTensor needs its block_size")
    return q.data.to(torch.float32) * expand_tiles(q.scale.float(), q.shape[-2], q.block_size)


def quantize_fp8_groups(
    x: torch.Tensor, *, scale: torch.Tensor | None, block_size: int | None, where: str
) -> QuantizedTensor:
    """``x`` to float8_e4m3fn with one ``amax / 448`` per group of ``b`` along the last dim
    (an activation: per token and group, at run time); ``scale`` is unused."""
    b = _need_block(x, block_size, where)
    groups = x.detach().to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // b, b)
    scales = safe_scale(groups.abs().amax(dim=-1), FP8_MAX, where=where)
    scaled = (groups / scales.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
    codes = scaled.to(torch.float8_e4m3fn).reshape(x.shape)
    return QuantizedTensor(_INPUTS, codes, scales, None, b, tuple(x.shape), x.dtype)


def dequantize_fp8_groups(q: QuantizedTensor) -> torch.Tensor:
    """``codes * group scale`` in float32."""
    if q.block_size is None:
        raise ValueError("an fp8_group QuantizedTensor needs its block_size")
    groups = q.data.to(torch.float32).reshape(*q.shape[:-1], -1, q.block_size)
    return (groups * q.scale.float().unsqueeze(-1)).reshape(q.shape)


_LEAVES = (
    Leaf("weight", torch.float8_e4m3fn, source="data"),
    Leaf("weight_scale", torch.float32, source="scale"),
)

#: The name transformers (``FP8Linear``) and vLLM (``Fp8LinearMethod.create_weights``: "The
#: weight_scale_inv name is intentional for deepseekv3") give the tile scales.
_SCALE_INV = "weight_scale_inv"


def _to_scale_inv(leaves: LeafTensors) -> dict[str, torch.Tensor]:
    return {"weight": leaves["weight"], _SCALE_INV: leaves["weight_scale"]}


def _from_scale_inv(leaves: LeafTensors) -> dict[str, torch.Tensor]:
    return {"weight": leaves["weight"], "weight_scale": leaves[_SCALE_INV]}


#: The same tensors under DeepSeek-V3's names: ``weight`` and ``weight_scale_inv`` (float32,
#: ``[ceil(out / b), in / b]``, multiplied by: the codes times it are the weight).
_FINEGRAINED = FineGrainedFP8Scheme(
    LeafCodec(
        weights=(
            StoredLeaf("weight", torch.float8_e4m3fn, "codes"),
            StoredLeaf(_SCALE_INV, torch.float32, "scale"),
        ),
        encode=_to_scale_inv,
        decode=_from_scale_inv,
    )
)


def _modelopt_scale_shapes(native: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The stored shapes of tile scales ``[..., ob, ib]``, the written one first: ModelOpt
    0.47's block amax keeps the reduced dims, ``[..., ob, 1, ib, 1]``, which vLLM's
    ``KFp8Block128`` registers; the 2-D form its ``process`` also takes; and for one tile the
    0-d scale ModelOpt writes where the quantizer's amax is one element (``reduce_amax``
    squeezes it), read but not written: vLLM's loader cannot ``narrow`` it."""
    *lead, ob, ib = native
    four = (*lead, ob, 1, ib, 1)
    return (four, native, ()) if math.prod(native) == 1 else (four, native)


def _to_modelopt(leaves: LeafTensors) -> dict[str, torch.Tensor]:
    scale = leaves["weight_scale"]
    return {
        "weight": leaves["weight"],
        "weight_scale": scale.reshape(_modelopt_scale_shapes(tuple(scale.shape))[0]),
    }


def _from_modelopt(leaves: LeafTensors) -> dict[str, torch.Tensor]:
    """The tile scales ``[..., ob, ib]`` of ModelOpt's ``[..., ob, 1, ib, 1]`` (or 0-d, or 2-D),
    refused unless they are one per tile of some edge ``b`` (``in / ib``) over the weight."""
    weight, scale = leaves["weight"], leaves["weight_scale"]
    *lead, rows, cols = weight.shape
    stored = tuple(scale.shape)
    if len(stored) >= 4 and stored[-1] == stored[-3] == 1 and stored[:-4] == tuple(lead):
        native = (*stored[:-4], stored[-4], stored[-2])
    elif stored == () and not lead:
        native = (1, 1)
    else:
        native = stored
    ib = native[-1] if len(native) == len(lead) + 2 else 0
    block = cols // ib if ib and cols % ib == 0 else 0
    want = (*lead, -(-rows // block), ib) if block else None
    if native != want:
        b = DEFAULT_BLOCK
        vllm = [*lead, -(-rows // b), 1, -(-cols // b), 1]
        raise ValueError(
            f"weight_scale has shape {list(stored)}, which is no tile grid of the weight "
            f"{list(weight.shape)}: ModelOpt's FP8_PB_WO stores [ceil(out / b), 1, in / b, 1] "
            f"for tiles of b x b ({vllm} for vLLM's b = {b})"
        )
    return {"weight": weight, "weight_scale": scale.reshape(native)}


#: ModelOpt's FP8_PB_WO (``quant_algo: "fp8_pb_wo"``, what ModelOpt 0.47's
#: ``FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG`` exports): ``weight`` float8_e4m3fn and ``weight_scale``
#: float32 ``[ceil(out / 128), 1, in / 128, 1]`` (ModelOpt's own: 0-d for one tile). Its config
#: records no block size (vLLM reads 128 x 128), so only blocks of 128 are written; vLLM's
#: ``resolve`` runs the inputs per 128-group at run time (W8A8), which is this format's model.
_MODELOPT = ModelOptScheme(
    "fp8_pb_wo",
    weights={"dynamic": False, "num_bits": 8, "type": "float"},
    config_groups=False,
    codec=LeafCodec(
        weights=(
            StoredLeaf("weight", torch.float8_e4m3fn, "codes"),
            StoredLeaf("weight_scale", torch.float32, "scale"),
        ),
        encode=_to_modelopt,
        decode=_from_modelopt,
        scale_shapes=_modelopt_scale_shapes,
    ),
    block_sizes=(DEFAULT_BLOCK,),
    group_size_field=False,
    named_group=True,
)

#: The inputs' format: FP8 per group of the last dimension, scales from the data. No
#: layout stores a weight in it (no scheme): ``fp8_block`` layers' inputs only.
FP8_GROUP = FormatSpec(
    format=_INPUTS,
    quantize=quantize_fp8_groups,
    dequantize=dequantize_fp8_groups,
    maxbound=FP8_MAX,
    amax_divisor=FP8_MAX,
    granularity="block",
    leaves=_LEAVES,
    block_size=DEFAULT_BLOCK,
)

FP8_BLOCK = FormatSpec(
    format=_NAME,
    quantize=quantize_fp8_tiles,
    dequantize=dequantize_fp8_tiles,
    maxbound=FP8_MAX,
    amax_divisor=FP8_MAX,
    granularity="tile",
    leaves=_LEAVES,
    block_size=DEFAULT_BLOCK,
    activations=_INPUTS,
    compressed_tensors=CompressedTensorsScheme(
        "float-quantized", weights=_CT_WEIGHTS, input_activations=_CT_INPUTS
    ),
    finegrained_fp8=_FINEGRAINED,
    modelopt=_MODELOPT,
)
