"""What a manifest records about the model and the environment: JSON-safe facts, no files.

:func:`model_hash` (the model's exact structure and weights), :func:`json_safe` (options
as JSON data) and :func:`versions` (the libraries an artifact depends on). The manifest
itself, and how artifacts are verified against it, live in
:mod:`~exportlm.export.manifest`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from importlib import metadata
from typing import Any

__all__ = ["json_safe", "model_hash", "versions"]


def model_hash(model: Any) -> str:
    """sha256 of ``model``'s structure and weights: class, then every state-dict entry in name order.

    Each entry contributes its name, dtype, shape and raw bytes (exact: no float is
    compared, the bytes are hashed), so the same weights give the same hash on any
    machine. Tensors are read on the CPU; a model on the ``meta`` device has no
    bytes and must be refused before this is called.
    """
    digest = hashlib.sha256(f"{type(model).__module__}.{type(model).__qualname__}\n".encode())
    state = model.state_dict()
    for name in sorted(state):
        if not hasattr(state[name], "detach"):  # an extra state that is not a tensor
            digest.update(f"{name}|{state[name]!r}\n".encode())
            continue
        tensor = state[name].detach()
        header = f"{name}|{str(tensor.dtype).removeprefix('torch.')}|{list(tensor.shape)}\n"
        digest.update(header.encode())
        if tensor.numel():
            flat = tensor.cpu().contiguous().reshape(-1)
            digest.update(flat.view(_uint8()).numpy().tobytes())
    return digest.hexdigest()


def _uint8() -> Any:
    import torch

    return torch.uint8


def json_safe(value: Any) -> Any:
    """``value`` as JSON data: tensors become ``{"tensor": shape, "dtype": ...}``, paths and dtypes strings."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return {"tensor": list(shape), "dtype": str(dtype).removeprefix("torch.")}
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value).removeprefix("torch.")


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


#: The library each built-in runtime loads with.
_RUNTIME_LIBRARY = {
    "onnx": "onnxruntime",
    "torchscript": "torch",
    "torch_export": "torch",
    "hf_checkpoint": "safetensors",
}


def versions(runtime: str | None) -> dict[str, str | None]:
    """Versions of exportlm, torch, transformers and of ``runtime``'s library."""
    found = {name: _version(name) for name in ("exportlm", "torch", "transformers")}
    library = _RUNTIME_LIBRARY.get(runtime or "")
    if library is not None:
        found[f"runtime:{library}"] = _version(library)
    return found
