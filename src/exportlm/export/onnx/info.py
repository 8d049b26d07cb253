"""``get_onnx_info``: what an ONNX file declares, read without loading its weights.

Needs the optional ``onnx`` package (the ``onnx`` extra);
:class:`~exportlm.errors.MissingDependencyError` without it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exportlm.export._optional import require_modules

__all__ = ["OnnxInfo", "OnnxValueInfo", "get_onnx_info"]


@dataclass(frozen=True)
class OnnxValueInfo:
    """One graph input or output: name, element type and dims (int, symbolic name or None)."""

    name: str
    dtype: str
    dims: tuple[int | str | None, ...]


@dataclass(frozen=True)
class OnnxInfo:
    """What :func:`get_onnx_info` reads from an ONNX file without loading its weights."""

    path: Path
    opset: int
    ir_version: int
    producer: str
    inputs: tuple[OnnxValueInfo, ...]
    outputs: tuple[OnnxValueInfo, ...]
    node_count: int
    initializer_count: int
    initializer_bytes: int
    external_data_files: tuple[str, ...]


def _value_info(value: Any) -> OnnxValueInfo:
    import onnx

    tensor_type = value.type.tensor_type
    dims: list[int | str | None] = []
    for dim in tensor_type.shape.dim:
        if dim.HasField("dim_value"):
            dims.append(int(dim.dim_value))
        elif dim.HasField("dim_param"):
            dims.append(str(dim.dim_param))
        else:
            dims.append(None)
    dtype = onnx.TensorProto.DataType.Name(tensor_type.elem_type).lower()
    return OnnxValueInfo(value.name, dtype, tuple(dims))


def _initializer_bytes(tensor: Any) -> tuple[int, str | None]:
    """(byte size, external file or None) of one initializer, without reading external data."""
    import onnx

    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        entries = {e.key: e.value for e in tensor.external_data}
        if "length" in entries:
            size = int(entries["length"])
        else:
            itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
            size = math.prod(tensor.dims) * itemsize
        return size, entries.get("location")
    if tensor.raw_data:
        return len(tensor.raw_data), None
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return math.prod(tensor.dims) * itemsize, None


def get_onnx_info(path: str | os.PathLike[str]) -> OnnxInfo:
    """Read opset, inputs/outputs (with symbolic dims), node count, weight bytes and external files.

    External data is not loaded, so this is cheap even for large models.

    Raises:
        MissingDependencyError: the ``onnx`` package is not installed.
        FileNotFoundError: no file at ``path``.
    """
    require_modules("onnx", extra="onnx", purpose="reading an ONNX file with get_onnx_info")
    import onnx

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"no ONNX file at {file}")
    proto = onnx.load(str(file), load_external_data=False)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    sizes = [_initializer_bytes(t) for t in proto.graph.initializer]
    return OnnxInfo(
        path=file,
        opset=int(opset),
        ir_version=int(proto.ir_version),
        producer=f"{proto.producer_name} {proto.producer_version}".strip(),
        inputs=tuple(_value_info(v) for v in proto.graph.input),
        outputs=tuple(_value_info(v) for v in proto.graph.output),
        node_count=len(proto.graph.node),
        initializer_count=len(proto.graph.initializer),
        initializer_bytes=sum(size for size, _ in sizes),
        external_data_files=tuple(sorted({loc for _, loc in sizes if loc})),
    )
