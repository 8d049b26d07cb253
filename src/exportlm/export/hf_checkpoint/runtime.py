"""The ``hf_checkpoint`` runtime: rebuild the model from the directory and run it.

:func:`load_hf_checkpoint` rebuilds the model class from ``config.json``,
dequantizes every quantized weight back to float with the same function the
fake quantizer uses, in the format the checkpoint declares
(:mod:`~exportlm.export.hf_checkpoint.formats`,
:mod:`~exportlm.export.hf_checkpoint.dequantize`), stacks split experts back
into the model's own layout (:mod:`~exportlm.export.hf_checkpoint.experts`),
re-applies static input / KV-cache quantization with the stored scales
(:mod:`~exportlm.export.hf_checkpoint.static`) and the run-time (dynamic) input
quantization the checkpoint's formats declare (W8A8: int8 per token), and returns
``input_ids -> logits``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exportlm.errors import ExportLMError, InvalidInputError, MalformedCheckpointError
from exportlm.export._wrapper import extract_logits
from exportlm.export.hf_checkpoint.dequantize import DequantizedState, dequantize_state
from exportlm.export.hf_checkpoint.experts import (
    _SPLIT_LINEARS,
    SPLIT_EXPERT,
    fuse_split_experts,
    native_experts,
)
from exportlm.export.hf_checkpoint.formats import StoredFormats
from exportlm.export.hf_checkpoint.naming import CheckpointNamer
from exportlm.export.hf_checkpoint.static import StaticQuantization
from exportlm.export.hf_checkpoint.untrusted import (
    StoredTensors,
    check_layer_count,
    check_shapes,
    read_model_config,
    read_stored_tensors,
)
from exportlm.export.runtime import TorchModuleRuntime, resolve_device

__all__ = ["KVRoundtrip", "kv_cache_roundtrip", "load_hf_checkpoint"]


def load_hf_checkpoint(
    artifact: Path, *, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None
) -> TorchModuleRuntime:
    """Runtime of ``hf_checkpoint``: rebuild, dequantize, and return ``input_ids -> logits``.

    The model class comes from ``config.json``'s ``architectures``; quantized
    weights, in any registered format, are dequantized to float exactly as the fake
    quantizer computes them; static input scales (of linears and of stacked experts)
    and KV-cache scales are re-applied by :mod:`exportlm.quant`'s own quantized
    modules, loaded with the stored scales, as a serving engine applies them.
    Attention runs ``eager`` (the reference implementation) and ``use_cache=False``.
    ``dtype`` is the compute dtype (default: ``config.json``'s, else float32):
    ``dtype="float32"`` computes a bfloat16 checkpoint's stored values without rounding
    its activations, as the served comparison's eager reference does.
    The returned runtime refuses non-integer, empty and out-of-vocabulary ``input_ids``
    (the vocabulary is ``config.json``'s ``vocab_size``) with
    :class:`~exportlm.errors.InvalidInputError`, as the other runtimes do.

    The directory is untrusted input (:mod:`~exportlm.export.hf_checkpoint.untrusted`):
    its configs, index and safetensors headers are validated, and its shards confined
    to it, before transformers or safetensors read them; transformers is always called
    with ``trust_remote_code=False``.

    Raises:
        MalformedCheckpointError: a config, the index, a header or a tensor is
            malformed (missing, not JSON, a wrong field type or value, a shard outside
            the directory, a NaN / infinite / non-positive scale, weights that do not
            fit the model); the message names the file and the field or tensor.
        CustomCodeRefusedError: loading would run the checkpoint's own code (``auto_map``,
            ``*.py``).
        NotRegularFileError: a file it reads is a FIFO, a device or a directory.
        InvalidInputError: the architecture is not in this transformers, or ``device``
            is not a device.
        RuntimeUnavailableError: ``device`` is CUDA and this machine has none.
        UnsupportedFormatError: the checkpoint declares (or stores) a quantization
            format no registered :class:`~exportlm.quant.formats.FormatSpec` has.
    """
    directory = Path(artifact)
    model_device = resolve_device(device, "hf_checkpoint")
    model = _rebuild_model(directory, model_device, _compute_dtype(dtype))
    vocab = getattr(model.config.get_text_config(), "vocab_size", None)
    return TorchModuleRuntime(
        functools.partial(model, use_cache=False),
        model_device,
        "hf_checkpoint",
        vocab_size=vocab if isinstance(vocab, int) and vocab > 0 else None,
    )


@dataclass(frozen=True)
class KVRoundtrip:
    """How far the checkpoint's runtime logits are from the fake-quant model's.

    Attributes:
        max_abs: the largest absolute logits difference.
        relative: ``||runtime - fake_quant|| / ||fake_quant||`` (Frobenius norms).
    """

    max_abs: float
    relative: float

    def passed(self, rtol: float = 1e-3) -> bool:
        """``relative <= rtol``."""
        return self.relative <= rtol


def kv_cache_roundtrip(
    model: Any, artifact: Path, input_ids: torch.Tensor, *, device: str | torch.device = "cpu"
) -> KVRoundtrip:
    """Compare the fake-quant ``model`` with the checkpoint run the way a serving engine runs it.

    The runtime (:func:`load_hf_checkpoint`) quantizes the cached K (after RoPE and
    any per-head norm) and V with the stored ``k_scale`` / ``v_scale`` as vLLM's FP8
    KV cache does (``fp8(K / k_scale)``, dequantized as ``fp8 * k_scale``), and applies
    every other stored scale; the fake-quant ``model`` uses its calibrated quantizers.
    Scales that do not fit the cached tensors (e.g. ``1.0`` where ``|K|`` is near
    ``1e-3``: the cache lands in FP8 subnormals) show as a large ``relative`` error.
    """
    run = load_hf_checkpoint(artifact, device=device)
    with torch.no_grad():
        output = model(input_ids.to(device), use_cache=False)
    expected = extract_logits(output, where="the fake-quant model").float()
    got = run(input_ids).float()
    diff = got - expected
    scale = float(torch.linalg.vector_norm(expected)) or 1.0
    return KVRoundtrip(
        max_abs=float(diff.abs().max()), relative=float(torch.linalg.vector_norm(diff)) / scale
    )


def _compute_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype), None)
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise InvalidInputError(
            f"dtype={dtype!r} is not a torch floating-point dtype; expected e.g. 'float32' or "
            "'bfloat16'"
        )
    return found


def _rebuild_model(directory: Path, device: torch.device, dtype: torch.dtype | None) -> Any:
    import transformers

    read_model_config(directory)  # every config check, and no custom code, before transformers
    config = _auto_config(transformers, directory)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # we dequantize ourselves; transformers must not
    arch = config.architectures[0]
    model_cls = getattr(transformers, arch, None)
    if not (isinstance(model_cls, type) and issubclass(model_cls, transformers.PreTrainedModel)):
        raise InvalidInputError(
            f"{directory / 'config.json'} names architecture {arch!r}, which this transformers "
            f"({transformers.__version__}) does not have; install a version that does"
        )
    stored = read_stored_tensors(directory)
    check_layer_count(config, stored)  # before any model is built: a huge count would hang
    weights, activation_scales, dynamic, native = _dequantized(directory, stored)
    skeleton = _skeleton(model_cls, config, directory)
    weights = native_experts(weights, native, skeleton)  # gpt-oss's [E, out, in] blocks
    if not _has_conversion_table(config) and any(SPLIT_EXPERT.match(n) for n in weights):
        # transformers merges split experts only through a conversion table: without
        # one, stack them into the experts' own layout, read off the empty model
        weights = fuse_split_experts(weights, skeleton)
    check_shapes(skeleton, weights, stored)
    model = _from_state_dict(model_cls, config, weights, directory, dtype)
    model.eval()
    StaticQuantization(model, activation_scales, set(stored.tensors)).apply(model)
    _quantize_inputs_at_run_time(model, dynamic)
    # Moved after the static scales are loaded: they are buffers of the quantizers, so
    # they land on ``device`` with the weights. A scale left on the CPU would still
    # work on CUDA, but as a CPU scalar, which CUDA divides by through its reciprocal:
    # activations would round differently from the fake-quant model's.
    return model.to(device)


def _skeleton(model_cls: Any, config: Any, directory: Path) -> Any:
    """An empty (``meta``) model of ``config``: the parameters' paths and shapes only.

    The config passed every rule first; a dependency's error left building it is still
    the file's defect, and is reported as such naming ``config.json``.
    """
    try:
        with torch.device("meta"):
            return model_cls(config)
    except (AttributeError, TypeError, ValueError, KeyError, IndexError) as err:
        path = directory / "config.json"
        raise MalformedCheckpointError(
            f"{path}: transformers cannot build {model_cls.__name__} from it "
            f"({type(err).__name__}: {err}); fix the file or export the model again",
            path=path,
        ) from err


def _auto_config(transformers: Any, directory: Path) -> Any:
    """transformers' config of ``directory`` (already validated), never running its code."""
    try:
        return transformers.AutoConfig.from_pretrained(directory, trust_remote_code=False)
    except Exception as err:  # any failure to parse a validated dict is the file's defect
        if isinstance(err, ExportLMError):
            raise
        path = directory / "config.json"
        raise MalformedCheckpointError(
            f"{path}: transformers cannot build a config from it ({type(err).__name__}: {err}); "
            "fix the file or export the model again",
            path=path,
        ) from err


def _quantize_inputs_at_run_time(model: Any, dynamic: dict[str, Any]) -> None:
    """Quantize the inputs of the layers in ``dynamic`` (``{layer path: (format, block)}``)
    at run time.

    The layer's input quantizer is enabled in the declared format with no stored
    scale, so each scale comes from the activation itself, as the fake quantizer
    computes it (W8A8's ``int8``: one scale per token, the last dimension) and as vLLM's
    ``compressed_tensors_w8a8_int8`` does. Split experts (``experts.{e}.gate_proj``)
    set the input quantizer their projection shares.
    """
    if not dynamic:
        return
    from exportlm.quant import QuantExperts, QuantLinear, wrap_module

    namer = CheckpointNamer(model)
    found: list[tuple[Any, Any]] = []
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantExperts):
            found += _expert_inputs(name, module, namer, dynamic)
        elif isinstance(module, torch.nn.Linear):
            fmt = dynamic.get(namer.module_name(name))
            if fmt is not None:
                wrapper = module if isinstance(module, QuantLinear) else wrap_module(module, name)
                found.append((wrapper.input_quantizer, fmt))
    from exportlm.quant.formats import get_format

    for quantizer, (fmt, block) in found:
        quantizer.format, quantizer.axis, quantizer.enabled = fmt, None, True
        # a block format quantizes each token in its blocks: the layer's declared group
        # (fp8_block's inputs), else the format's own block (MXFP8's inputs)
        quantizer.block_size = block if block is not None else get_format(fmt).block_size


def _expert_inputs(
    name: str, experts: Any, namer: CheckpointNamer, dynamic: dict[str, Any]
) -> list[tuple[Any, Any]]:
    """``(input quantizer, format)`` of each projection of ``experts`` whose split linears
    (``{name}.{e}.gate_proj``...) ``dynamic`` names."""
    found = []
    for projection in experts.PROJECTIONS:
        count = experts.canonical_weight(projection).shape[0]
        paths = [
            f"{name}.{e}.{linear}" for e in range(count) for linear in _SPLIT_LINEARS[projection]
        ]
        formats = [dynamic[p] for p in map(namer.module_name, paths) if p in dynamic]
        if formats:
            found.append((experts.input_quantizer_of(projection), formats[0]))
    return found


def _dequantized(directory: Path, stored: StoredTensors) -> DequantizedState:
    """The float weights, static scales and dynamic inputs, every defect an exportlm error
    naming the file."""
    try:
        declared = StoredFormats.read(directory)
    except (ValueError, TypeError, AttributeError, KeyError) as err:
        if isinstance(err, ExportLMError):
            raise
        raise MalformedCheckpointError(
            f"{directory}: the quantization configs cannot be read ({type(err).__name__}: {err})",
            path=directory,
        ) from err
    try:
        state = dequantize_state(stored.tensors, declared)
    except MalformedCheckpointError as err:
        file = err.path or stored.file_of(err.field)
        raise MalformedCheckpointError(f"{file}: {err}", path=file, field=err.field) from err
    except (RuntimeError, ValueError, TypeError, IndexError) as err:
        if isinstance(err, ExportLMError):
            raise
        raise MalformedCheckpointError(
            f"{directory}: the stored codes and scales do not fit together "
            f"({type(err).__name__}: {err}); the checkpoint is corrupted",
            path=directory,
        ) from err
    for name, tensor in state.weights.items():
        if not (tensor.is_floating_point() or name in state.scales):
            file = stored.file_of(name)
            raise MalformedCheckpointError(
                f"{file}: tensor {name} is stored as {str(tensor.dtype).removeprefix('torch.')}, "
                "but it is neither quantized codes (no scale beside it) nor a float weight; "
                "the header's dtype is wrong",
                path=file,
                field=name,
            )
    return state


def _from_state_dict(
    model_cls: Any,
    config: Any,
    weights: dict[str, torch.Tensor],
    directory: Path,
    dtype: torch.dtype | None = None,
) -> Any:
    """``model_cls`` built from ``weights``; a missing, unexpected or misshapen weight is refused."""
    from transformers.utils import logging as hf_logging

    progress = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a runtime load is not a download: no bar per call
    try:
        model, info = model_cls.from_pretrained(
            None,
            config=config,
            state_dict=weights,
            dtype=dtype or config.dtype or torch.float32,
            attn_implementation="eager",
            trust_remote_code=False,
            output_loading_info=True,
        )
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as err:
        raise MalformedCheckpointError(
            f"{directory}: the weights do not fit {model_cls.__name__} as config.json describes "
            f"it ({type(err).__name__}: {err}); the checkpoint is corrupted",
            path=directory,
        ) from err
    finally:
        if progress:
            hf_logging.enable_progress_bar()
    wrong = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    if wrong:
        kind, names = next(iter(wrong.items()))
        raise MalformedCheckpointError(
            f"{directory}: {kind.replace('_', ' ')} {', '.join(map(str, names[:5]))}: the saved "
            f"tensors are not the weights of {model_cls.__name__} as config.json describes it; "
            "the checkpoint is corrupted or incomplete",
            path=directory,
            field=str(names[0]),
        )
    return model


def _has_conversion_table(config: Any) -> bool:
    """True when transformers itself merges split experts of this model type on load."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return False
    return get_checkpoint_conversion_mapping(config.model_type) is not None
