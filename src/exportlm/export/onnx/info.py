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
from exportlm.inspection import read_onnx_model

__all__ = ["OnnxInfo", "OnnxQuantizedInitializer", "OnnxValueInfo", "get_onnx_info"]


@dataclass(frozen=True)
class OnnxValueInfo:
    """One graph input or output: name, element type and dims (int, symbolic name or None)."""

    name: str
    dtype: str
    dims: tuple[int | str | None, ...]


@dataclass(frozen=True)
class OnnxQuantizedInitializer:
    """One quantized initializer: the stored codes a ``DequantizeLinear`` node reads.

    Attributes:
        name: the initializer's name (a quantized linear's ``<module>.weight``).
        dtype: its ONNX element type, lower case (``"float8e4m3fn"``, ``"int8"``).
        dims: its shape.
        bytes: its stored size in bytes (read from the header; external data is not loaded).
        scale: the name of the scale the ``DequantizeLinear`` node multiplies it by.
    """

    name: str
    dtype: str
    dims: tuple[int, ...]
    bytes: int
    scale: str


@dataclass(frozen=True)
class OnnxInfo:
    """What :func:`get_onnx_info` reads from an ONNX file without loading its weights.

    ``initializer_bytes`` counts every initializer; ``quantized_initializers`` are the
    ones a ``DequantizeLinear`` node reads (the quantized weights of a QDQ graph, in
    graph order), ``quantized_bytes`` their total. Both are empty / 0 for a float graph.
    """

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
    quantized_initializers: tuple[OnnxQuantizedInitializer, ...] = ()
    quantized_bytes: int = 0


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


def _quantized_initializers(graph: Any, sizes: dict[str, int]) -> list[OnnxQuantizedInitializer]:
    """The initializers read as input 0 of a ``DequantizeLinear`` node, each once."""
    import onnx

    initializers = {t.name: t for t in graph.initializer}
    found: dict[str, OnnxQuantizedInitializer] = {}
    for node in graph.node:
        if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
            continue
        tensor = initializers.get(node.input[0])
        if tensor is None or tensor.name in found:
            continue  # an activation's QuantizeLinear output, or seen already
        found[tensor.name] = OnnxQuantizedInitializer(
            name=tensor.name,
            dtype=onnx.TensorProto.DataType.Name(tensor.data_type).lower(),
            dims=tuple(int(d) for d in tensor.dims),
            bytes=sizes[tensor.name],
            scale=node.input[1],
        )
    return list(found.values())


def get_onnx_info(path: str | os.PathLike[str]) -> OnnxInfo:
    """Read opset, inputs/outputs (with symbolic dims), node count, weight bytes and external files.

    For a QDQ graph (a quantized model exported by the ``onnx`` target) it also lists the
    quantized initializers (name, dtype, dims, bytes, scale) and their total bytes.

    External data is not loaded, so this is cheap even for large models.

    Raises:
        MissingDependencyError: the ``onnx`` package is not installed.
        FileNotFoundError: no file at ``path``.
        InputTooLargeError: a file over 2 GiB (protobuf's limit), refused before it is read.
    """
    require_modules("onnx", extra="onnx", purpose="reading an ONNX file with get_onnx_info")

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"no ONNX file at {file}")
    proto = read_onnx_model(file)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    sizes = [_initializer_bytes(t) for t in proto.graph.initializer]
    by_name = {t.name: size for t, (size, _) in zip(proto.graph.initializer, sizes, strict=True)}
    quantized = _quantized_initializers(proto.graph, by_name)
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
        quantized_initializers=tuple(quantized),
        quantized_bytes=sum(q.bytes for q in quantized),
    )
