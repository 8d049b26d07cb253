"""The ``hf_checkpoint`` export target: a (quantized) Hugging Face checkpoint directory.

Layout (see ``docs/checkpoint-format.md``)::

    out/
      model.safetensors                  # or model-0000i-of-0000N.safetensors + index
      model.safetensors.index.json       # only when sharded
      config.json                        # the model's config (+ quantization_config)
      generation_config.json             # when the model can generate
      hf_quant_config.json               # only when quantized, modelopt format

The export driver (:func:`exportlm.modules.export_quantized_state`) walks the
model one module at a time and hands every tensor to a sink; here the sink
renames it to the name the model's own ``save_pretrained`` writes and feeds the
streaming shard writer, so no full state dict is ever built. The directory is
assembled in a temporary sibling and swapped in atomically.

Only transformers ``PreTrainedModel`` instances are accepted: the checkpoint's
``config.json`` must name a model class that the runtime (and vLLM, TensorRT-LLM,
SGLang, transformers) can rebuild. A plain torch decoder gets a clear reason.

The runtime :func:`load_hf_checkpoint` rebuilds the model class from
``config.json``, dequantizes every quantized weight back to float with the same
function the fake quantizer uses, re-applies static input / KV-cache
quantization with the stored scales (:func:`exportlm.quant.wrap_module`), and
returns ``input_ids -> logits``.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple, cast

import torch
from torch import nn

from exportlm.errors import (
    ExportFailedError,
    InvalidInputError,
    InvalidModelError,
    UnsupportedFormatError,
)
from exportlm.export._base import atomic_output, export_target
from exportlm.export._hf_naming import CheckpointNamer
from exportlm.export._safetensors_writer import (
    INDEX_NAME,
    SINGLE_FILE_NAME,
    ShardedSafetensorsWriter,
)
from exportlm.export._wrapper import extract_logits

__all__ = [
    "CHECKPOINT_FORMATS",
    "HF_QUANT_CONFIG_NAME",
    "build_hf_checkpoint_exporter",
    "export_hf_checkpoint",
    "load_hf_checkpoint",
]

logger = logging.getLogger(__name__)

HF_QUANT_CONFIG_NAME = "hf_quant_config.json"
#: ``format=`` values: the ModelOpt layout, or compressed-tensors' FP8 ``float-quantized``.
CHECKPOINT_FORMATS = ("modelopt", "compressed-tensors")

_SCALE_LEAVES = (
    "weight_scale",
    "weight_scale_2",
    "input_scale",
    "pre_quant_scale",
    "k_scale",
    "v_scale",
)

# ModelOpt's `quantization_config` groups per algorithm (modelopt.torch.export.convert_hf_config).
_FP8_ARGS = {"dynamic": False, "num_bits": 8, "type": "float"}
_GROUP_CONFIGS: dict[str, Callable[[int | None], dict[str, Any]]] = {
    "FP8": lambda gs: {"input_activations": dict(_FP8_ARGS), "weights": dict(_FP8_ARGS)},
    "NVFP4": lambda gs: {
        "input_activations": {
            "dynamic": False,
            "num_bits": 4,
            "type": "float",
            "group_size": gs or 16,
        },
        "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": gs or 16},
    },
    "W4A16_AWQ": lambda gs: {
        "weights": {"dynamic": False, "num_bits": 4, "type": "int", "group_size": gs or 128}
    },
    "W8A16": lambda gs: {"weights": {"dynamic": False, "num_bits": 8, "type": "int"}},
}


# --------------------------------------------------------------------------- target declaration


def _hf_accepts(model: Any) -> str | None:
    """Why this target cannot take ``model``, or ``None``."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return "transformers is not installed"
    if not isinstance(model, PreTrainedModel):
        return (
            f"{type(model).__name__} is not a transformers PreTrainedModel; a Hugging Face "
            "checkpoint needs a config.json naming a model class that loaders can rebuild "
            "(export plain torch models with onnx, torch_export or torchscript)"
        )
    return None


def build_hf_checkpoint_exporter() -> Callable[..., Path]:
    """Entry point of ``exportlm.export_backends``: the declared ``hf_checkpoint`` factory."""
    return export_hf_checkpoint


@export_target(
    "hf_checkpoint",
    runtime="hf_checkpoint",
    # Unquantized: the same float weights, the diff is 0. Quantized: measured 0 for
    # FP8 / NVFP4 / INT8 on every tiny family, < 4e-7 for AWQ (folded pre_quant_scale);
    # the bound is looser for any user model (op order, attention kernels); see docs.
    atol=1e-4,
    rtol=1e-3,
    capabilities={"quantized", "multi_file"},
    artifact="directory",
    accepts=_hf_accepts,
    description="Hugging Face checkpoint directory (safetensors shards; ModelOpt or compressed-tensors quantization)",
)
def export_hf_checkpoint(
    model: nn.Module,
    output_path: Path,
    *,
    format: Literal["modelopt", "compressed-tensors"] = "modelopt",
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    is_qlora: bool = False,
    example_inputs: Any = None,
    safe_serialization: bool = True,
) -> Path:
    """Write ``model`` (quantized with :func:`exportlm.quant.quantize`, or not) as an HF checkpoint.

    Args:
        model: a transformers ``PreTrainedModel``; never modified.
        output_path: the checkpoint directory. An existing non-empty directory is
            refused unless ``overwrite=True``, which replaces it atomically.
        format: ``"modelopt"`` (vLLM / TensorRT-LLM / SGLang) or
            ``"compressed-tensors"`` (FP8 ``float-quantized``, transformers).
        max_shard_size: bytes per shard, an int or ``"500MB"``-style string.
        dtype: cast unquantized floating tensors to this dtype (default: as in the model).
        overwrite: replace an existing non-empty directory.
        is_qlora: drop LoRA adapters and write ``base_layer`` weights under the base names.
        example_inputs: accepted for API uniformity; nothing is traced.
        safe_serialization: must be true: the checkpoint is safetensors only, never pickle.

    Returns:
        ``output_path``.
    """
    del example_inputs  # weights only: there is nothing to trace
    if not safe_serialization:
        raise InvalidInputError(
            "hf_checkpoint writes safetensors only (pickle checkpoints can run code on load); "
            "drop safe_serialization=False"
        )
    if format not in CHECKPOINT_FORMATS:
        raise InvalidInputError(
            f"format must be one of {', '.join(CHECKPOINT_FORMATS)}, got {format!r}"
        )
    reason = _hf_accepts(model)
    if reason:
        raise InvalidModelError(f"hf_checkpoint cannot export this model: {reason}")
    from exportlm.modules import export_quantized_state

    output = Path(output_path)
    with atomic_output(output, directory=True, overwrite=overwrite) as staging:
        writer = ShardedSafetensorsWriter(staging, max_shard_size=max_shard_size)
        sink = _CheckpointSink(CheckpointNamer(model), writer, format)
        try:
            summary = export_quantized_state(
                model, sink, format=format, dtype=dtype, is_qlora=is_qlora
            )
        finally:
            sink.close()
        written = writer.finish()
        quant = _quantization_section(summary, _module_namer(model, sink.namer, is_qlora))
        _write_configs(model, staging, dtype, quant, format)
        logger.info(
            "hf_checkpoint: wrote %d tensors (%d bytes) in %d file(s) to %s",
            len(written.weight_map),
            written.total_size,
            len(written.files),
            output,
        )
    return output


class _CheckpointSink:
    """The driver's sink: rename to checkpoint names (and the format's layout), then write."""

    def __init__(
        self, namer: CheckpointNamer, writer: ShardedSafetensorsWriter, format: str
    ) -> None:
        self.namer = namer
        self._writer = writer
        self._compressed_tensors = format == "compressed-tensors"
        self._closed = False

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Accept one tensor from the export driver."""
        if self._closed:
            raise ExportFailedError(f"tensor {name!r} arrived after the export finished")
        for ckpt_name, value in self.namer.rename(name, tensor):
            if self._compressed_tensors:
                ckpt_name, value = _to_compressed_tensors(ckpt_name, value)
            self._writer.add(ckpt_name, value)

    def close(self) -> None:
        self._closed = True


_KV_SCALE = re.compile(r"^(?P<attn>.*)\.(?P<proj>[kv])_proj\.(?P=proj)_scale$")


def _to_compressed_tensors(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """compressed-tensors layout: per-tensor scales have shape ``[1]``; KV scales sit on the attention."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("weight_scale", "input_scale", "k_scale", "v_scale") and tensor.dim() == 0:
        tensor = tensor.reshape(1)
    match = _KV_SCALE.match(name)
    if match:
        name = f"{match['attn']}.{match['proj']}_scale"
    return name, tensor


# --------------------------------------------------------------------------- configs


def _module_namer(
    model: nn.Module, namer: CheckpointNamer, is_qlora: bool
) -> Callable[[str], str | None]:
    """In-memory module path -> the module path its tensors are saved under (``None``: not saved).

    The path the module's ``weight`` is written under, through the same steps as the
    tensors: a tied weight is written under its source (a tied ``lm_head`` is the
    saved ``model.embed_tokens``), QLoRA drops ``base_layer`` (the driver's own
    sink), then :meth:`CheckpointNamer.module_name` (transformers' save-time renaming:
    Mixtral ``mlp.gate`` -> ``block_sparse_moe.gate``, split experts ``w1``/``w2``/``w3``).
    A QLoRA adapter, whose tensors are dropped, is not saved.
    """
    from exportlm.modules import resolve_tied_weights
    from exportlm.modules._driver import _QLoRASink

    ties = resolve_tied_weights(model)  # {dropped tensor name: kept tensor name}

    def saved_module(module: str) -> str | None:
        weight = f"{module}.weight"
        weight = ties.get(weight, weight)
        if is_qlora:
            probe = _NameProbe()
            _QLoRASink(probe).add(weight, probe.placeholder)
            if not probe.name:
                return None  # an adapter: dropped with its tensors
            weight = probe.name
        if not weight.endswith(".weight"):
            return module
        return namer.module_name(weight.removesuffix(".weight"))

    return saved_module


class _NameProbe:
    """A sink that keeps the name it is handed: maps a name through a sink chain."""

    placeholder = torch.empty(())

    def __init__(self) -> None:
        self.name = ""

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.name = name


def _quantization_section(
    summary: Any, saved_module: Callable[[str], str | None] = lambda m: m
) -> dict[str, Any] | None:
    """The ``quantization`` section of ``hf_quant_config.json``; ``None`` for an unquantized model.

    Module names (``exclude_modules``, ``quantized_layers``) are mapped with
    ``saved_module`` to the prefixes of the tensors the checkpoint saves (modules it
    does not save are left out), so every ``config.json`` list built from this
    section names saved modules too.
    """
    quant_algo = getattr(summary, "quant_algo", None)
    kv_algo = getattr(summary, "kv_cache_quant_algo", None)
    if quant_algo is None and kv_algo is None:
        return None
    excluded = {saved_module(m) for m in getattr(summary, "exclude_modules", None) or []}
    section: dict[str, Any] = {
        "quant_algo": quant_algo,
        "kv_cache_quant_algo": kv_algo,
        "exclude_modules": sorted(m for m in excluded if m is not None),
    }
    group_size = getattr(summary, "group_size", None)
    if group_size:
        section["group_size"] = group_size
    if quant_algo == "W4A16_AWQ":
        section.update(has_zero_point=False, pre_quant_scale=True)
    layers = getattr(summary, "quantized_layers", None)
    if quant_algo == "MIXED_PRECISION" and layers:
        saved = {saved_module(k): dict(v) for k, v in dict(layers).items()}
        section["quantized_layers"] = {k: saved[k] for k in sorted(k for k in saved if k)}
    return section


def _producer() -> dict[str, str]:
    from exportlm import __version__

    return {"name": "exportlm", "version": __version__}


def modelopt_quantization_config(quant: Mapping[str, Any]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` for the ModelOpt layout (as ModelOpt writes it)."""
    algo = quant.get("quant_algo")
    config: dict[str, Any] = {}
    if algo == "MIXED_PRECISION":
        by_config: dict[tuple[tuple[str, Any], ...], list[str]] = {}
        for layer, cfg in quant.get("quantized_layers", {}).items():
            by_config.setdefault(tuple(sorted(cfg.items())), []).append(layer)
        groups = {}
        for i, (key, layers) in enumerate(by_config.items()):
            cfg = dict(key)
            groups[f"group_{i}"] = {
                **_group_config(cfg["quant_algo"], cfg.get("group_size")),
                "targets": sorted(layers),
            }
        config["config_groups"] = groups
        config["quantized_layers"] = quant.get("quantized_layers", {})
    elif algo is not None:
        config["config_groups"] = {
            "group_0": {**_group_config(algo, quant.get("group_size")), "targets": ["Linear"]}
        }
    config["ignore"] = list(quant.get("exclude_modules") or [])
    if algo:
        config["quant_algo"] = algo
    kv = quant.get("kv_cache_quant_algo")
    if kv:
        config["kv_cache_scheme"] = dict(_FP8_ARGS) if kv == "FP8" else kv
    config["producer"] = _producer()
    config["quant_method"] = "modelopt"
    return config


def _group_config(algo: str, group_size: int | None) -> dict[str, Any]:
    try:
        return _GROUP_CONFIGS[algo](group_size)
    except KeyError:
        raise UnsupportedFormatError(
            f"no quantization_config group is defined for quant_algo {algo!r}; "
            f"known: {', '.join(sorted(_GROUP_CONFIGS))}"
        ) from None


def compressed_tensors_quantization_config(quant: Mapping[str, Any]) -> dict[str, Any]:
    """``quantization_config`` for compressed-tensors' FP8 ``float-quantized`` format."""
    if quant.get("quant_algo") not in ("FP8", None):
        raise UnsupportedFormatError(
            f"format='compressed-tensors' writes FP8 per-tensor (float-quantized) only, but the model "
            f"is quantized as {quant.get('quant_algo')!r}; use format='modelopt' or quantize with 'fp8'"
        )
    args = {
        "num_bits": 8,
        "type": "float",
        "strategy": "tensor",
        "symmetric": True,
        "dynamic": False,
    }
    groups = {}
    if quant.get("quant_algo") == "FP8":
        groups["group_0"] = {
            "targets": ["Linear"],
            "weights": dict(args),
            "input_activations": dict(args),
            "format": "float-quantized",
        }
    ignore = [_ct_ignore_entry(m) for m in quant.get("exclude_modules") or []]
    kv = quant.get("kv_cache_quant_algo")
    if kv not in (None, "FP8"):
        raise UnsupportedFormatError(
            f"compressed-tensors output supports an FP8 KV cache only, got {kv!r}"
        )
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": ignore,
        "kv_cache_scheme": dict(args) if kv == "FP8" else None,
    }


def _ct_ignore_entry(pattern: str) -> str:
    """A ModelOpt wildcard (``*.mlp.gate``) becomes a compressed-tensors ``re:`` pattern."""
    if "*" not in pattern:
        return pattern
    return "re:" + ".*".join(re.escape(part) for part in pattern.split("*")) + "$"


def _write_configs(
    model: Any,
    directory: Path,
    dtype: torch.dtype | None,
    quant: dict[str, Any] | None,
    format: str,
) -> None:
    """config.json (+ quantization_config), generation_config.json, hf_quant_config.json."""
    config: Any = copy.deepcopy(
        model.config
    )  # save_pretrained mutates the model's config; we do not
    model_dtype = dtype or _floating_dtype(model)
    config.dtype = str(model_dtype).removeprefix("torch.")
    config.architectures = [type(model).__name__]
    if quant is not None:
        config.quantization_config = (
            compressed_tensors_quantization_config(quant)
            if format == "compressed-tensors"
            else modelopt_quantization_config(quant)
        )
        if format == "modelopt":
            hf_quant = {"producer": _producer(), "quantization": quant}
            (directory / HF_QUANT_CONFIG_NAME).write_text(json.dumps(hf_quant, indent=4) + "\n")
    config.save_pretrained(directory)
    can_generate = getattr(model, "can_generate", None)
    generation_config = getattr(model, "generation_config", None)
    if callable(can_generate) and can_generate() and generation_config is not None:
        generation_config.save_pretrained(directory)


def _floating_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


# --------------------------------------------------------------------------- runtime


def load_hf_checkpoint(
    artifact: Path, *, device: str | torch.device = "cpu"
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Runtime of ``hf_checkpoint``: rebuild, dequantize, and return ``input_ids -> logits``.

    The model class comes from ``config.json``'s ``architectures``; quantized
    weights are dequantized to float exactly as the fake quantizer computes them;
    static input scales (FP8, NVFP4; of linears and of fused experts) and FP8
    KV-cache scales are re-applied by :mod:`exportlm.quant`'s own quantized
    modules, loaded with the stored scales, as a serving engine applies them.
    Attention runs ``eager`` (the reference implementation) and ``use_cache=False``.
    """
    directory = Path(artifact)
    model = _rebuild_model(directory, torch.device(device))
    model_device = torch.device(device)

    def run(input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            output = model(input_ids.to(model_device), use_cache=False)
        return extract_logits(output, where=f"hf_checkpoint {directory.name}")

    return run


def _rebuild_model(directory: Path, device: torch.device) -> Any:
    import transformers
    from transformers.utils import logging as hf_logging

    config_path = directory / "config.json"
    if not config_path.is_file():
        raise InvalidInputError(
            f"{directory} is not a Hugging Face checkpoint: it has no config.json"
        )
    config = transformers.AutoConfig.from_pretrained(directory)
    quant_config = getattr(config, "quantization_config", None)
    if quant_config is not None:
        del config.quantization_config  # we dequantize ourselves; transformers must not
    arch = (config.architectures or [None])[0]
    model_cls = getattr(transformers, arch, None) if arch else None
    if model_cls is None:
        raise InvalidInputError(
            f"{config_path} names architecture {arch!r}, which this transformers "
            f"({transformers.__version__}) does not have; install a version that does"
        )
    tensors = dict(_read_checkpoint(directory))
    group_size = _group_size(directory)
    weights, activation_scales = _dequantize_state(tensors, group_size)
    if not _has_conversion_table(config):
        weights = _fuse_bmm_experts(weights)
    progress = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a runtime load is not a download: no bar per call
    try:
        model = model_cls.from_pretrained(
            None,
            config=config,
            state_dict=weights,
            dtype=config.dtype or torch.float32,
            attn_implementation="eager",
        )
    finally:
        if progress:
            hf_logging.enable_progress_bar()
    model.eval().to(device)
    _StaticQuantization(model, activation_scales, set(tensors)).apply(model)
    return model


def _read_checkpoint(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = directory / INDEX_NAME
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / SINGLE_FILE_NAME).is_file():
        files = [SINGLE_FILE_NAME]
    else:
        raise InvalidInputError(f"{directory} holds neither {SINGLE_FILE_NAME} nor {INDEX_NAME}")
    for file in files:
        with safe_open(str(directory / file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield key, f.get_tensor(key)


def _group_size(directory: Path) -> int | None:
    path = directory / HF_QUANT_CONFIG_NAME
    if not path.is_file():
        return None
    size = json.loads(path.read_text()).get("quantization", {}).get("group_size")
    return int(size) if size else None


class _ActivationScale(NamedTuple):
    """A static activation scale of the checkpoint: its format, value and NVFP4 block."""

    format: Any  # exportlm.quant.QuantFormat
    scale: torch.Tensor
    block_size: int | None = None


def _activation_scale(
    prefix: str, leaf: str, tensor: torch.Tensor, tensors: Mapping[str, torch.Tensor]
) -> _ActivationScale | None:
    """What an ``input_scale`` / ``k_scale`` / ``v_scale`` quantizes to, or ``None`` (not one)."""
    from exportlm.quant import QuantFormat

    scale = tensor.float()
    if leaf in ("k_scale", "v_scale"):
        return _ActivationScale(QuantFormat.FP8, scale)
    weight = tensors.get(f"{prefix}.weight")
    if leaf != "input_scale" or weight is None:
        return None
    if weight.dtype == torch.float8_e4m3fn:
        return _ActivationScale(QuantFormat.FP8, scale)
    block_scale = tensors.get(f"{prefix}.weight_scale")
    if f"{prefix}.weight_scale_2" in tensors and block_scale is not None:
        # packed [out, in / 2] codes with one block scale per `block` inputs
        block = weight.shape[-1] * 2 // block_scale.shape[-1]
        return _ActivationScale(QuantFormat.NVFP4, scale, block)
    return None


def _dequantize_state(
    tensors: dict[str, torch.Tensor], group_size: int | None
) -> tuple[dict[str, torch.Tensor], dict[str, _ActivationScale]]:
    """(float weights under checkpoint names, activation/KV scales by scale name)."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, _ActivationScale] = {}
    for name, tensor in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf in _SCALE_LEAVES:
            activation = _activation_scale(prefix, leaf, tensor, tensors)
            if activation is not None:
                scales[name] = activation
            continue
        if leaf == "weight" and f"{prefix}.weight_scale" in tensors:
            weights[name] = _dequantize_weight(prefix, tensors, group_size)
        else:
            weights[name] = tensor
    return weights, scales


def _dequantize_weight(
    prefix: str, tensors: Mapping[str, torch.Tensor], group_size: int | None
) -> torch.Tensor:
    """One module's float weight from its stored codes and scales (``exportlm.quant.dequantize``)."""
    from exportlm.quant import QuantFormat, QuantizedTensor, dequantize

    data = tensors[f"{prefix}.weight"]
    scale = tensors[f"{prefix}.weight_scale"]
    scale_2 = tensors.get(f"{prefix}.weight_scale_2")
    fmt = _STORED_FORMATS.get((data.dtype, scale_2 is not None))
    if fmt is None:
        raise UnsupportedFormatError(
            f"{prefix}.weight is stored as {data.dtype} with weight_scale {tuple(scale.shape)}; "
            "expected FP8 (float8_e4m3fn), NVFP4 (uint8 + weight_scale_2), INT4 AWQ (uint8) or INT8 (int8)"
        )
    fmt = QuantFormat(fmt)
    block: int | None = None
    shape: tuple[int, ...]
    if fmt is QuantFormat.NVFP4:
        shape = (data.shape[0], data.shape[1] * 2)
        block = shape[1] // scale.shape[-1]
    elif fmt is QuantFormat.INT4:
        shape = (data.shape[0] * 2, data.shape[1])
        block = group_size or shape[1] // scale.shape[-1]
    else:
        shape = tuple(data.shape)
        scale = scale.reshape(()) if fmt is QuantFormat.FP8 else scale.reshape(-1)
    q = QuantizedTensor(
        fmt,
        data,
        scale.float() if fmt is not QuantFormat.NVFP4 else scale,
        scale_2,
        block,
        tuple(shape),
        torch.float32,
    )
    weight: torch.Tensor = dequantize(q)
    pre_quant_scale = tensors.get(f"{prefix}.pre_quant_scale")
    if pre_quant_scale is not None:  # AWQ: y = (x * s) @ W^T == x @ (W * s)^T
        weight = weight * pre_quant_scale.float().reshape(1, -1)
    return weight


_SPLIT_EXPERT = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.(?P<leaf>weight|bias)$"
)


def _has_conversion_table(config: Any) -> bool:
    """True when transformers itself merges split experts of this model type on load."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return False
    return get_checkpoint_conversion_mapping(config.model_type) is not None


def _fuse_bmm_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert ``[out, in]`` linears back into BMM experts (GptOss layout).

    ``gate_up_proj [E, H, 2I]`` with gate in the even and up in the odd columns,
    ``down_proj [E, I, H]``, biases ``gate_up_proj_bias [E, 2I]``, ``down_proj_bias [E, H]``:
    the inverse of the split the BMM-experts exporter writes, for models that
    transformers has no conversion table for.
    """
    groups: dict[tuple[str, str, str], dict[int, torch.Tensor]] = {}
    fused = {}
    for name, tensor in weights.items():
        match = _SPLIT_EXPERT.match(name)
        if match is None:
            fused[name] = tensor
            continue
        groups.setdefault((match["prefix"], match["proj"], match["leaf"]), {})[int(match["e"])] = (
            tensor
        )
    for (prefix, proj, leaf), by_expert in groups.items():
        if proj == "up":
            continue
        stacked = torch.stack([by_expert[e] for e in sorted(by_expert)])
        if leaf == "weight":
            stacked = stacked.transpose(1, 2)
        suffix = "" if leaf == "weight" else "_bias"
        if proj == "down":
            fused[f"{prefix}.down_proj{suffix}"] = stacked.contiguous()
            continue
        up_by_expert = groups[(prefix, "up", leaf)]
        up = torch.stack([up_by_expert[e] for e in sorted(up_by_expert)])
        up = up.transpose(1, 2) if leaf == "weight" else up
        gate_up = torch.stack((stacked, up), dim=-1).flatten(-2)  # interleave along the last dim
        fused[f"{prefix}.gate_up_proj{suffix}"] = gate_up.contiguous()
    return fused


#: (stored weight dtype, has weight_scale_2) -> QuantFormat value.
_STORED_FORMATS: dict[tuple[torch.dtype, bool], str] = {
    (torch.float8_e4m3fn, False): "fp8",
    (torch.uint8, True): "nvfp4",
    (torch.uint8, False): "int4",
    (torch.int8, False): "int8",
}


class _StaticQuantization:
    """Re-applies a checkpoint's static activation scales to the rebuilt model.

    Every module that owns a scale is converted with :func:`exportlm.quant.wrap_module`
    (weights pass through: they are already dequantized) and the scale is loaded
    into its input / KV quantizer with :meth:`TensorQuantizer.load_scale`, so the
    runtime runs the fake quantizer's own forward: ``nn.Linear`` input and KV-cache
    scales, and the per-projection input scales of fused / BMM experts (shared by
    the experts of a block). Fused experts whose weights were quantized are
    wrapped even without activation scales, so that they route tokens exactly as
    the fake-quantized experts do. Checkpoint names of a module's scales come
    from the export's own :class:`CheckpointNamer` applied to the rebuilt model.
    """

    def __init__(
        self, model: nn.Module, scales: Mapping[str, _ActivationScale], tensor_names: set[str]
    ) -> None:
        self._namer = CheckpointNamer(model)
        self._placeholder = torch.empty(())  # rename() maps names; the tensor is not used
        self._scales = scales
        self._tensor_names = tensor_names
        self._used: set[str] = set()

    def apply(self, model: nn.Module) -> None:
        """Wrap and load every scale; warn about scales no module owns."""
        from exportlm.quant import is_fused_experts

        for name, module in list(model.named_modules()):
            if is_fused_experts(module):
                self._experts(name, module)
            elif isinstance(module, nn.Linear):
                self._linear(name, module)
        unused = sorted(set(self._scales) - self._used)
        if unused:
            logger.warning(
                "hf_checkpoint runtime: %d activation scale(s) belong to no module of the "
                "rebuilt model and are not applied: %s",
                len(unused),
                ", ".join(unused[:5]) + (" ..." if len(unused) > 5 else ""),
            )

    def _checkpoint_name(self, name: str) -> str:
        return next(iter(self._namer.rename(name, self._placeholder)))[0]

    def _take(self, *names: str) -> _ActivationScale | None:
        """The first scale stored under one of ``names`` (in-model names), marked used."""
        for name in names:
            key = self._checkpoint_name(name)
            if key in self._scales:
                self._used.add(key)
                return self._scales[key]
        return None

    def _linear(self, name: str, module: nn.Linear) -> None:
        from exportlm.quant import QuantLinear, wrap_module

        attention, _, leaf = name.rpartition(".")
        role = {"k_proj": "k", "v_proj": "v"}.get(leaf)
        inputs = self._take(f"{name}.input_scale")
        # ModelOpt stores KV scales on k_proj / v_proj, compressed-tensors on the attention
        kv = self._take(f"{name}.{role}_scale", f"{attention}.{role}_scale") if role else None
        if inputs is None and kv is None:
            return
        wrapper = cast(QuantLinear, wrap_module(module, name))
        if inputs is not None:
            quantizer = wrapper.input_quantizer
            quantizer.load_scale(inputs.scale, inputs.format, block_size=inputs.block_size)
        if kv is not None:
            wrapper.output_quantizer.load_scale(kv.scale, kv.format)

    def _experts(self, name: str, module: nn.Module) -> None:
        from exportlm.quant import QuantExperts, wrap_module

        gate_up: torch.Tensor = module.get_parameter("gate_up_proj")
        count = gate_up.shape[0]
        per_projection = {
            "gate_up_proj": [
                self._take(f"{name}.{e}.{linear}.input_scale")
                for e in range(count)
                for linear in ("gate_proj", "up_proj")
            ],
            "down_proj": [self._take(f"{name}.{e}.down_proj.input_scale") for e in range(count)],
        }
        quantized = self._checkpoint_name(f"{name}.0.down_proj.weight_scale") in self._tensor_names
        if not quantized and all(s is None for found in per_projection.values() for s in found):
            return
        wrapper = cast(QuantExperts, wrap_module(module, name))
        for projection, found in per_projection.items():
            present = [s for s in found if s is not None]
            if not present:
                continue
            if len({s.format for s in present}) > 1 or len(present) < len(found):
                raise UnsupportedFormatError(
                    f"{name}.{projection}: the experts' input scales are missing for some "
                    "experts or mix formats; the experts of one block share one static input "
                    "quantizer, so every expert needs an input_scale of the same format"
                )
            # one shared input quantizer per projection: the block's largest scale
            # (what the exporter writes for every expert, and what vLLM uses)
            scale = torch.stack([s.scale.reshape(()) for s in present]).amax()
            quantizer = wrapper.input_quantizer_of(projection)
            quantizer.load_scale(scale, present[0].format, block_size=present[0].block_size)
