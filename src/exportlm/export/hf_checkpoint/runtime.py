"""The ``hf_checkpoint`` runtime: rebuild the model from the directory and run it.

:func:`load_hf_checkpoint` rebuilds the model class from ``config.json``,
dequantizes every quantized weight back to float with the same function the
fake quantizer uses, in the format the checkpoint declares
(:mod:`~exportlm.export.hf_checkpoint.formats`,
:mod:`~exportlm.export.hf_checkpoint.dequantize`), stacks split experts back
into the model's own layout (:mod:`~exportlm.export.hf_checkpoint.experts`),
re-applies static input / KV-cache quantization with the stored scales
(:mod:`~exportlm.export.hf_checkpoint.static`), and returns ``input_ids -> logits``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exportlm.errors import InvalidInputError
from exportlm.export._wrapper import extract_logits
from exportlm.export.hf_checkpoint.dequantize import dequantize_state
from exportlm.export.hf_checkpoint.experts import SPLIT_EXPERT, fuse_split_experts
from exportlm.export.hf_checkpoint.formats import StoredFormats
from exportlm.export.hf_checkpoint.sink import INDEX_NAME, SINGLE_FILE_NAME
from exportlm.export.hf_checkpoint.static import StaticQuantization
from exportlm.export.runtime import TorchModuleRuntime, resolve_device

__all__ = ["KVRoundtrip", "kv_cache_roundtrip", "load_hf_checkpoint"]


def load_hf_checkpoint(artifact: Path, *, device: str | torch.device = "cpu") -> TorchModuleRuntime:
    """Runtime of ``hf_checkpoint``: rebuild, dequantize, and return ``input_ids -> logits``.

    The model class comes from ``config.json``'s ``architectures``; quantized
    weights, in any registered format, are dequantized to float exactly as the fake
    quantizer computes them; static input scales (of linears and of stacked experts)
    and KV-cache scales are re-applied by :mod:`exportlm.quant`'s own quantized
    modules, loaded with the stored scales, as a serving engine applies them.
    Attention runs ``eager`` (the reference implementation) and ``use_cache=False``.
    The returned runtime refuses non-integer, empty and out-of-vocabulary ``input_ids``
    (the vocabulary is ``config.json``'s ``vocab_size``) with
    :class:`~exportlm.errors.InvalidInputError`, as the other runtimes do.

    Raises:
        InvalidInputError: ``artifact`` is not a Hugging Face checkpoint directory,
            or ``device`` is not a device.
        RuntimeUnavailableError: ``device`` is CUDA and this machine has none.
        UnsupportedFormatError: the checkpoint declares (or stores) a quantization
            format no registered :class:`~exportlm.quant.formats.FormatSpec` has.
    """
    directory = Path(artifact)
    model_device = resolve_device(device, "hf_checkpoint")
    model = _rebuild_model(directory, model_device)
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
    weights, activation_scales = dequantize_state(tensors, StoredFormats.read(directory))
    if not _has_conversion_table(config) and any(SPLIT_EXPERT.match(n) for n in weights):
        # transformers merges split experts only through a conversion table: without
        # one, stack them into the experts' own layout, read off an empty (meta) model
        with torch.device("meta"):
            skeleton = model_cls(config)
        weights = fuse_split_experts(weights, skeleton)
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
    model.eval()
    StaticQuantization(model, activation_scales, set(tensors)).apply(model)
    # Moved after the static scales are loaded: they are buffers of the quantizers, so
    # they land on ``device`` with the weights. A scale left on the CPU would still
    # work on CUDA, but as a CPU scalar, which CUDA divides by through its reciprocal:
    # activations would round differently from the fake-quant model's.
    return model.to(device)


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


def _has_conversion_table(config: Any) -> bool:
    """True when transformers itself merges split experts of this model type on load."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return False
    return get_checkpoint_conversion_mapping(config.model_type) is not None
