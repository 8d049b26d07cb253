"""Stored codes and scales back to float weights, and the static scales set aside.

:func:`dequantize_state` finds every quantized weight of a checkpoint, reads it
with its format's :meth:`~exportlm.quant.formats.FormatSpec.from_leaves` and
dequantizes it with :func:`exportlm.quant.dequantize` (the function the fake
quantizer computes with, so the float weight equals the fake-quantized one),
folds AWQ's ``pre_quant_scale`` in, sets the static activation and KV-cache
scales aside as :class:`ActivationScale` for
:class:`~exportlm.export.hf_checkpoint.static.StaticQuantization`, and names the
layers whose inputs are quantized at run time (:attr:`DequantizedState.dynamic`:
a format whose recipe quantizes inputs in a format with no calibrated scale, as the
compressed-tensors config's ``input_activations`` with ``dynamic: true`` declares
for W8A8's per-token int8 inputs).

A quantized weight is stored under its format's leaf names or under the names
the checkpoint layout gives them (compressed-tensors' ``weight_packed``,
``weight_shape``, ``weight_global_scale``, ``input_global_scale``: the layout's
:class:`~exportlm.quant.formats.LeafCodec` decodes them), in one of two arrangements:

* a module's ``<module>.weight`` with ``<module>.weight_scale``, ``<module>.input_scale``...
  (every linear, split experts ``experts.{e}.gate_proj``);
* a bare parameter ``<module>.<param>`` with ``<module>.<param>_weight_scale``,
  ``<module>.<param>_input_scale``... (experts kept in their model's own fused
  layout, DBRX ``ffn.experts.mlp.w1``); a per-tensor format may then hold one
  scale per expert: the codes are ``E`` stacked slices, each with its own scale;
* a parameter stored as its leaves ``<module>.<param>_<leaf>`` (a layout of
  ``native_experts``: gpt-oss's ``experts.gate_up_proj_blocks`` / ``_scales``): the float
  weight is ``<module>.<param>``, in the layout's canonical ``[E, out, in]``
  (:attr:`DequantizedState.native`, laid out as the model's parameter by the runtime).

The leaf names (``weight``, ``weight_scale``, ``input_scale``, ``k_scale``...) and
what each format stores under them come from the registered format specs.

Every scale read here is checked first (:func:`check_scale`): a NaN or an
infinity anywhere, a negative entry, or a per-tensor scale that is not positive
raises :class:`~exportlm.errors.MalformedCheckpointError` naming the tensor, so a
corrupted scale is refused instead of turning the logits into NaN.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from exportlm.errors import MalformedCheckpointError, UnsupportedFormatError
from exportlm.export.hf_checkpoint._leaves import Leaves, Slot, slots
from exportlm.export.hf_checkpoint.formats import StoredFormats
from exportlm.quant import dequantize
from exportlm.quant.formats import (
    CheckpointLayout,
    FormatSpec,
    get_format,
)

__all__ = ["ActivationScale", "DequantizedState", "check_scale", "dequantize_state"]

#: The activation leaves whose meaning the format spec contract fixes.
_INPUT_SCALE = "input_scale"  # a recipe that quantizes inputs writes it
_PRE_QUANT_SCALE = "pre_quant_scale"  # an AWQ recipe writes it


def check_scale(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as float32 if it is a usable scale, else :class:`MalformedCheckpointError`.

    Usable: a float dtype, finite everywhere, no negative entry, and (a single value: a per-tensor
    scale, which loaders divide by) positive. Per-row and per-block scales may hold
    zeros (those rows dequantize to zero, as exported).
    """
    if not tensor.is_floating_point():
        raise MalformedCheckpointError(
            f"scale {name} is stored as {str(tensor.dtype).removeprefix('torch.')}, but scales "
            "are floats; the header's dtype is wrong. Export the checkpoint again",
            field=name,
        )
    values = tensor.float()
    bad = int((~torch.isfinite(values)).sum())
    if bad:
        raise MalformedCheckpointError(
            f"scale {name} holds {bad} NaN / infinite value(s) of {values.numel()}: every value "
            "it scales would be NaN. The checkpoint is corrupted; export it again",
            field=name,
        )
    single = values.numel() == 1
    if int((values < 0).sum()) or (single and float(values.reshape(())) <= 0):
        shown = (
            f"{float(values.reshape(())):g}" if single else f"{int((values < 0).sum())} negatives"
        )
        raise MalformedCheckpointError(
            f"scale {name} is {shown}: a scale is a positive magnitude (loaders divide by "
            "per-tensor scales). The checkpoint is corrupted; export it again",
            field=name,
        )
    return values


def check_e8m0_scale(name: str, tensor: torch.Tensor) -> None:
    """Refuse an E8M0 scale (uint8 biased exponents, the MX formats) holding 255, its NaN."""
    bad = int((tensor == 255).sum())
    if bad:
        raise MalformedCheckpointError(
            f"scale {name} holds {bad} E8M0 NaN code(s) (255) of {tensor.numel()}: every value "
            "it scales would be NaN. The checkpoint is corrupted; export it again",
            field=name,
        )


def check_native_blocks(
    slot: Slot, spec: FormatSpec, stored: Mapping[str, torch.Tensor], kinds: Mapping[str, str]
) -> None:
    """Refuse the leaves of a parameter stored as its leaves (gpt-oss's ``<p>_blocks`` with
    ``<p>_scales``) whose shapes disagree: codes ``[..., in / block, block / packing]``, each
    scale the codes' shape without the last dimension (one per block). ``kinds``: each stored
    leaf's kind (``codes``, ``scale``)."""
    codes = next((t for leaf, t in stored.items() if kinds.get(leaf) == "codes"), None)
    per_block = (spec.block_size or 1) // (spec.packing or 1)
    if not slot.native or codes is None or spec.block_size is None or codes.dim() < 2:
        return
    want = tuple(codes.shape[:-1])
    scales = {leaf: tuple(t.shape) for leaf, t in stored.items() if kinds.get(leaf) == "scale"}
    if codes.shape[-1] == per_block and all(shape == want for shape in scales.values()):
        return
    raise MalformedCheckpointError(
        f"{slot.data} has shape {list(codes.shape)} and its scales {scales}: {spec.name} stores "
        f"{per_block} bytes per block of {spec.block_size} and one scale per block ({list(want)}); "
        "the checkpoint is corrupted",
        field=slot.data,
    )


class ActivationScale(NamedTuple):
    """A static activation scale of the checkpoint: its format, value and block size."""

    format: Any  # exportlm.quant.FormatId
    scale: torch.Tensor
    block_size: int | None = None
    #: SmoothQuant: the scale the input is multiplied by before it is quantized (the
    #: dequantized weight is the stored, smoothed one).
    pre_quant_scale: torch.Tensor | None = None
    #: ``scale`` is compressed-tensors' global scale (NVFP4's ``input_global_scale``),
    #: which quantization divides by, as compressed-tensors does.
    divides: bool = False


class DequantizedState(NamedTuple):
    """What :func:`dequantize_state` reads out of a checkpoint's tensors."""

    #: The float weights (and every other tensor), by checkpoint name.
    weights: dict[str, torch.Tensor]
    #: The static activation / KV-cache scales, by checkpoint name of the scale.
    scales: dict[str, ActivationScale]
    #: ``{layer path: (input format, block size or None)}`` of the layers whose inputs are
    #: quantized at run time, with no stored scale (W8A8's per-token int8: a format whose
    #: spec is not ``calibrated``; FP8_BLOCK's groups of the weight's block); the layer
    #: path is the one the quantization config lists.
    dynamic: dict[str, Any]
    #: The float weights of parameters stored as their leaves (``<param>_blocks``), as
    #: ``[E, out, in]``: their model's own layout is the runtime's to restore.
    native: frozenset[str] = frozenset()


def dequantize_state(
    tensors: Mapping[str, torch.Tensor], declared: StoredFormats
) -> DequantizedState:
    """The float weights, static scales and run-time-quantized inputs of a checkpoint's tensors.

    ``declared`` names each layer's format (:meth:`StoredFormats.read`). Tensors
    that are no quantized weight and no scale pass through unchanged.

    Raises :class:`UnsupportedFormatError` for a format no registered spec has, an
    ``input_scale`` of a format that quantizes no activations, and a scale that
    belongs to no quantized weight.
    """
    leaves = Leaves.registered()
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, ActivationScale] = {}
    dynamic: dict[str, Any] = {}
    used: set[str] = set()
    native: set[str] = set()
    for slot in list(slots(tensors, leaves)):
        stored_leaves = _stored_leaves(slot, tensors, leaves)
        spec = declared.weight_format(slot.layer, stored_leaves)
        declared.check_tiles(slot.data, spec, stored_leaves)
        weight, block, names = _dequantize(slot, spec, tensors, leaves, declared.layout)
        weights[slot.weight(spec)] = weight
        used.update(names)
        if slot.native:
            native.add(slot.weight(spec))
        stored_input = declared.layout.activation_leaf(spec, _INPUT_SCALE, slot.data)
        input_scale = slot.name(stored_input.name, leaves.data)
        runtime_input = _runtime_input_format(spec)
        if runtime_input is not None and input_scale not in tensors:
            # a block input format (FP8_BLOCK's per-group inputs) groups by the weight's block
            dynamic[slot.layer] = (runtime_input, block if _blocked(runtime_input) else None)
        elif input_scale in tensors:
            if spec.activations is None:
                raise UnsupportedFormatError(
                    f"{input_scale}: the checkpoint stores a static input scale, but "
                    f"{slot.data} is in format {spec.name!r}, which quantizes no activations"
                )
            value = check_scale(input_scale, tensors[input_scale])
            # compressed-tensors' input_global_scale: a divisor (NVFP4's global scale, used
            # as it is), else the reciprocal of the format's own input_scale
            divides = stored_input.reciprocal and spec.global_scale
            if stored_input.reciprocal and not divides:
                value = 1.0 / value
            elif tensors[input_scale].dtype in (torch.bfloat16, torch.float16):
                value = tensors[input_scale]  # quantized with in its own dtype, as written
            pre_quant_scale = slot.name(_PRE_QUANT_SCALE, leaves.data)
            smoothing = tensors[pre_quant_scale].float() if pre_quant_scale in tensors else None
            # keyed by the format's own leaf name, which the static quantization looks up
            scales[slot.name(_INPUT_SCALE, leaves.data)] = ActivationScale(
                spec.activations, value, block, smoothing, divides
            )
            used.add(input_scale)
    for name, tensor in tensors.items():
        if name in used:
            continue
        leaf = name.rpartition(".")[2]
        if leaf in leaves.kv_cache:
            value = check_scale(name, tensor)
            scales[name] = ActivationScale(declared.kv_cache_format(name).format, value)
        elif _is_scale(leaf, leaves):
            raise UnsupportedFormatError(
                f"{name} is a quantization scale, but the checkpoint stores no quantized "
                "weight it belongs to (no data leaf beside a weight scale); the checkpoint "
                "is incomplete or was written by another tool"
            )
        elif name not in weights:
            weights[name] = tensor
    return DequantizedState(weights, scales, dynamic, frozenset(native))


def _runtime_input_format(spec: FormatSpec) -> Any | None:
    """The format ``spec``'s inputs are quantized in at run time (no stored scale), or ``None``.

    A format whose layouts quantize inputs in a format that is not ``calibrated`` derives
    each scale from the activation itself (W8A8's ``int8``: one scale per token), as the
    config declares (compressed-tensors ``input_activations``: ``dynamic: true``).
    """
    if spec.activations is None:
        return None
    inputs = get_format(spec.activations)
    return None if inputs.calibrated else inputs.format


def _blocked(fmt: Any) -> bool:
    return get_format(fmt).needs_block


def _is_scale(leaf: str, leaves: Leaves) -> bool:
    """A scale leaf of a module (``weight_scale``) or of a bare parameter (``w1_weight_scale``)."""
    return leaf in leaves.scales or any(
        leaf.endswith(f"_{s}") for s in leaves.scales - leaves.kv_cache
    )


def _stored_leaves(
    slot: Slot, tensors: Mapping[str, torch.Tensor], leaves: Leaves
) -> dict[str, torch.Tensor]:
    """``{leaf name: tensor}`` of every registered weight leaf stored for ``slot``."""
    names = {leaf: slot.name(leaf, leaves.data) for leaf in leaves.weight}
    return {leaf: tensors[name] for leaf, name in names.items() if name in tensors}


def _dequantize(
    slot: Slot,
    spec: FormatSpec,
    tensors: Mapping[str, torch.Tensor],
    leaves: Leaves,
    layout: CheckpointLayout,
) -> tuple[torch.Tensor, int | None, list[str]]:
    """``(float32 weight, block size, tensor names read)`` of one quantized weight."""
    declared = {leaf.name: leaf for leaf in layout.weight_leaves(spec)}
    stored = {
        leaf: tensors[name]
        for leaf in declared
        if (name := slot.name(leaf, leaves.data)) in tensors
    }
    names = [slot.name(leaf, leaves.data) for leaf in stored]
    for leaf, name in zip(stored, names, strict=True):
        if declared[leaf].kind != "scale":
            continue
        if declared[leaf].dtype == torch.uint8 and stored[leaf].dtype == torch.uint8:
            check_e8m0_scale(name, stored[leaf])
        else:
            check_scale(name, stored[leaf])
    check_native_blocks(slot, spec, stored, {leaf: d.kind for leaf, d in declared.items()})
    scale = stored.get(_scale_leaf(spec))
    if spec.granularity == "tensor" and scale is not None and scale.numel() > 1:
        weight, block = _dequantize_stacked(slot, spec, stored, scale), None
    else:
        try:
            q = layout.from_leaves(spec, stored)
        except (UnsupportedFormatError, MalformedCheckpointError):
            raise
        except ValueError as err:  # a layout's codec: leaves that do not fit together
            raise MalformedCheckpointError(f"{slot.data}: {err}", field=slot.data) from err
        weight, block = dequantize(q, torch.float32), q.block_size
    pre_quant_scale = slot.name(_PRE_QUANT_SCALE, leaves.data)
    if pre_quant_scale in tensors:  # AWQ: y = (x * s) @ W^T == x @ (W * s)^T
        scale = check_scale(pre_quant_scale, tensors[pre_quant_scale])
        names.append(pre_quant_scale)
        # SmoothQuant (inputs quantized after the scale): the runtime scales the input
        if slot.name(_INPUT_SCALE, leaves.data) not in tensors:
            weight = weight * scale.reshape(1, -1)
    return weight, block, names


def _dequantize_stacked(
    slot: Slot, spec: FormatSpec, stored: Mapping[str, torch.Tensor], scale: torch.Tensor
) -> torch.Tensor:
    """A per-tensor format with one scale per stacked slice (experts ``[E * rows, cols]``)."""
    data = stored[spec.data_leaf.name]
    count = scale.numel()
    if data.dim() != 2 or data.shape[0] % count:
        raise UnsupportedFormatError(
            f"{slot.data}: {count} per-tensor scales for codes of shape {tuple(data.shape)}; "
            "expected [E * rows, cols] with one scale per expert"
        )
    slices = data.view(count, -1, data.shape[-1])
    flat = scale.reshape(-1)
    parts = []
    for index in range(count):
        part = {name: t for name, t in stored.items() if t is not data and t is not scale}
        part.update({spec.data_leaf.name: slices[index], _scale_leaf(spec): flat[index]})
        parts.append(dequantize(spec.from_leaves(part), torch.float32))
    return torch.cat(parts)


def _scale_leaf(spec: FormatSpec) -> str:
    return next(leaf.name for leaf in spec.weight_leaves if leaf.source == "scale")
