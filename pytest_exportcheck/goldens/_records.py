"""Describing tensors for a golden: dtype, shape, sha256 of the bytes, values or a summary.

Internal to :mod:`pytest_exportcheck.goldens`. torch and numpy are imported inside
the functions, so importing this module imports neither.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "SMALL_TENSOR",
    "safetensors_digest",
    "tensor_digest",
    "tensor_record",
    "tensor_values",
    "tensors_digest",
]

#: Tensors with at most this many elements carry their values in a golden.
SMALL_TENSOR = 32


def _host_bytes(tensor: Any) -> tuple[Any, bytes]:
    import torch

    host = tensor.detach().to("cpu").contiguous()
    return host, host.reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_digest(tensor: Any) -> dict[str, Any]:
    """``{"dtype", "shape", "sha256"}`` of a torch tensor's bytes (C-contiguous, on the host).

    ``dtype`` is torch's name without the ``torch.`` prefix (``"float8_e4m3fn"``).
    The bytes are read through a ``uint8`` view, so FP8 and bf16 hash exactly.
    """
    host, raw = _host_bytes(tensor)
    return {
        "dtype": str(host.dtype).removeprefix("torch."),
        "shape": list(host.shape),
        "sha256": hashlib.sha256(raw).hexdigest(),
    }


def _number(value: float, is_float: bool) -> float | int | str:
    """A JSON number that reads back to the same float32 (shortest repr); NaN/inf as text."""
    if not is_float:
        return int(value)
    if not math.isfinite(value):
        return str(value)
    import numpy as np

    return float(str(np.float32(value)))


def tensor_values(tensor: Any) -> list[float | int | str]:
    """Every element of ``tensor`` as JSON numbers (float32's shortest repr; NaN/inf as text)."""
    import torch

    host = tensor.detach().to("cpu")
    is_float = host.is_floating_point()
    flat = host.reshape(-1)
    flat = flat.to(torch.float32) if is_float else flat.to(torch.int64)
    return [_number(v, is_float) for v in flat.tolist()]


def _summary(host: Any) -> dict[str, Any]:
    """absmax, mean (an exactly rounded sum, so the same on every machine) and NaN/inf count."""
    import torch

    if not (host.is_floating_point() or host.dtype in (torch.int8, torch.uint8, torch.int32)):
        return {}
    values = host.reshape(-1).to(torch.float64)
    finite = values[torch.isfinite(values)].tolist()
    nonfinite = values.numel() - len(finite)
    absmax = max((abs(v) for v in finite), default=0.0)
    mean = math.fsum(finite) / len(finite) if finite else 0.0
    return {
        "absmax": float(f"{absmax:.6g}"),
        "mean": float(f"{mean:.6g}"),
        "nonfinite": nonfinite,
    }


def tensor_record(tensor: Any, small: int = SMALL_TENSOR) -> dict[str, Any]:
    """:func:`tensor_digest` plus ``values`` (at most ``small`` elements) or a ``summary``.

    Values are written as the shortest decimal that reads back to the same
    float32 (FP8 and bf16 are exact in float32); integer tensors as integers.
    The summary's mean is computed with an exactly rounded sum of the float64
    values, so it reads the same everywhere, but it is never compared: the hash
    decides.
    """
    record = tensor_digest(tensor)
    host, _ = _host_bytes(tensor)
    if host.numel() <= small:
        record["values"] = tensor_values(host)
    else:
        summary = _summary(host)
        if summary:
            record["summary"] = summary
    return record


def tensors_digest(
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
) -> dict[str, dict[str, Any]]:
    """name -> :func:`tensor_record` for a mapping (or pairs) of tensors, sorted by name."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    return {name: tensor_record(value) for name, value in sorted(items, key=lambda kv: kv[0])}


def safetensors_digest(directory: Path) -> dict[str, dict[str, Any]]:
    """:func:`tensors_digest` of every tensor in every ``*.safetensors`` file under ``directory``.

    Tensor names are unique across shards in a Hugging Face checkpoint; a name
    seen in two shards raises ``ValueError`` (it would make the golden ambiguous).
    """
    from safetensors import safe_open

    digest: dict[str, dict[str, Any]] = {}
    for shard in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if name in digest:
                    raise ValueError(
                        f"tensor {name!r} appears in more than one shard of {directory}"
                    )
                digest[name] = tensor_record(handle.get_tensor(name))
    return dict(sorted(digest.items()))
