"""What the format tests share: fixed token ids, a model's logits, its quantized linears, a
checkpoint's tensors (read, edited in place) and its compressed-tensors group, and a load of a
checkpoint without a manifest."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import exportlm
from exportlm.quant import QuantLinear

#: Two rows of 12 token ids below 256 (every toy family's vocabulary), seeded.
IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


def logits(model: Any, ids: torch.Tensor = IDS) -> torch.Tensor:
    """``model(ids)``'s logits without autograd (a transformers output or a bare tensor)."""
    with torch.no_grad():
        out = model(ids)
    return getattr(out, "logits", out)


def quant_linears(model: nn.Module) -> dict[str, QuantLinear]:
    """Every :class:`~exportlm.quant.QuantLinear` of ``model`` by its qualified name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``directory``, by name."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def ct_group(out: Path) -> dict[str, Any]:
    """The first ``config_groups`` entry of a compressed-tensors checkpoint's config."""
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    group: dict[str, Any] = config["config_groups"]["group_0"]
    return group


def assert_pack_quantized_as_compressed_tensors(
    tensors: dict[str, torch.Tensor], modules: Iterable[str], out: Path, format: str
) -> None:
    """Each module's ``weight_packed`` / ``weight_scale`` / ``weight_shape`` equal, dtype, shape
    and bytes, what compressed-tensors' own ``pack-quantized`` compressor writes for the
    weight our leaves stand for, under the scheme of ``out``'s config (its first group)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    from exportlm.quant import dequantize
    from exportlm.quant.formats import CHECKPOINT_LAYOUTS, get_format

    group = ct_group(out)
    scheme = QuantizationScheme.model_validate({k: v for k, v in group.items() if k != "format"})
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    layout, spec = CHECKPOINT_LAYOUTS["compressed-tensors"], get_format(format)
    for module in sorted(modules):
        ours = {
            leaf: tensors[f"{module}.{leaf}"]
            for leaf in ("weight_packed", "weight_scale", "weight_shape")
        }
        weight = dequantize(layout.from_leaves(spec, ours), torch.float32)
        theirs = compressor.compress(
            {"weight": weight, "weight_scale": ours["weight_scale"]}, scheme
        )
        assert set(theirs) == set(ours), module
        for leaf, mine in ours.items():
            ref = theirs[leaf].contiguous()
            assert (mine.dtype, mine.shape) == (ref.dtype, ref.shape), f"{module}.{leaf}"
            assert torch.equal(
                mine.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)
            )


def edit_checkpoint_tensors(out: Path, edits: dict[str, Any]) -> None:
    """Replace each named tensor of ``out``'s one shard by ``edit(tensor)`` and drop its
    manifest (the edit would break it): a checkpoint another writer could have written."""
    from safetensors.torch import load_file, save_file

    shard = next(out.glob("*.safetensors"))
    tensors = load_file(shard)
    for name, edit in edits.items():
        tensors[name] = edit(tensors[name])
    save_file(tensors, shard, metadata={"format": "pt"})
    (out / "exportlm-manifest.json").unlink(missing_ok=True)


def load_unverified(out: Path) -> Any:
    """``load_exported`` of a checkpoint with no manifest, its unverified warning silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no manifest: unverified
        return exportlm.load_exported("hf_checkpoint", out)
