"""Rules on ONNX files: opset, operators, external data, quantized initializers.

The model is read with :func:`read_onnx_model` (external data not loaded): only
the graph and the initializers' metadata, from a file of at most 2 GiB (protobuf's
limit; a larger file is an ``onnx-unreadable`` finding, never read); external-data
files are checked by size, never read.

Two rules are onnxruntime's own refusals, which the ``onnx`` runtime checks before
it creates a session (:func:`onnx_load_problems`, one implementation for both): an
operator in a domain onnxruntime ships no kernels for (a custom-op library would
have to be registered, and exportlm never registers one), and an external-data
location that leaves the model's directory, by name or through a symbolic link.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from exportlm.errors import MissingDependencyError, NotRegularFileError
from exportlm.inspection._files import escape_problem
from exportlm.inspection._onnx_file import read_onnx_model
from exportlm.inspection._rules import RULES, Finding, Severity

__all__ = ["ONNXRUNTIME_DOMAINS", "QUANTIZED_ONNX_DTYPES", "onnx_findings", "onnx_load_problems"]

#: Operator domains an onnxruntime build ships kernels for, without a custom-op library.
ONNXRUNTIME_DOMAINS = frozenset(
    {
        "",
        "ai.onnx",
        "ai.onnx.ml",
        "ai.onnx.training",
        "ai.onnx.preview.training",
        "com.microsoft",
        "com.microsoft.nchwc",
        "com.microsoft.experimental",
        "com.ms.internal.nhwc",
    }
)
#: Domains whose operators ``onnx.defs`` knows, so an unknown ``op_type`` there is caught too.
_SCHEMA_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")

#: Initializer dtypes that hold quantized codes, with the opset whose DequantizeLinear takes them.
QUANTIZED_ONNX_DTYPES: dict[str, int] = {
    "INT8": 10,
    "UINT8": 10,
    "FLOAT8E4M3FN": 19,
    "FLOAT8E4M3FNUZ": 19,
    "FLOAT8E5M2": 19,
    "FLOAT8E5M2FNUZ": 19,
    "INT4": 21,
    "UINT4": 21,
    "FLOAT4E2M1": 23,
}
#: Bits per element of the dtypes whose size is not a whole number of bytes.
_SUB_BYTE_BITS = {"INT4": 4, "UINT4": 4, "FLOAT4E2M1": 4}
_EXTERNAL = 1  # onnx.TensorProto.EXTERNAL


def _onnx() -> Any:
    try:
        import onnx
    except ImportError as err:
        raise MissingDependencyError(["onnx"], "onnx", "inspecting an ONNX file") from err
    return onnx


def onnx_findings(path: Path) -> tuple[list[Finding], dict[str, Any]]:
    """The findings of ONNX file ``path`` and its summary (opset, initializers, bytes)."""
    onnx = _onnx()
    try:
        model = read_onnx_model(path)
    except NotRegularFileError:
        raise
    except Exception as err:  # DecodeError, OSError, InputTooLargeError: the file is not ONNX
        finding = RULES["onnx-unreadable"].finding(
            path.name, f"{path.name} does not parse as an ONNX model: {type(err).__name__}: {err}"
        )
        return [finding], {}
    opset = next((int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    initializers = [_initializer(onnx, init, path.parent) for init in model.graph.initializer]
    findings = [
        RULES[rule].finding(subject, message) for rule, subject, message in _ops(onnx, model)
    ]
    findings += _external(initializers, path)
    findings += _opset(initializers, opset, path.name)
    quantized = [i for i in initializers if i["dtype"] in QUANTIZED_ONNX_DTYPES]
    by_dtype: dict[str, dict[str, int]] = {}
    for init in quantized:
        entry = by_dtype.setdefault(init["dtype"], {"initializers": 0, "bytes": 0})
        entry["initializers"] += 1
        entry["bytes"] += init["bytes"]
    if quantized:
        listing = ", ".join(
            f"{dtype}: {v['initializers']} ({v['bytes']} bytes)"
            for dtype, v in sorted(by_dtype.items())
        )
        findings.append(
            RULES["onnx-quantized-initializers"].finding(
                path.name, f"quantized initializers: {listing}", by_dtype=by_dtype
            )
        )
    summary = {
        "opset": opset,
        "initializers": len(initializers),
        "bytes": sum(i["bytes"] for i in initializers),
        "quantized": by_dtype,
        "external_files": sorted({i["location"] for i in initializers if i["location"]}),
    }
    return findings, summary


def _initializer(onnx: Any, init: Any, directory: Path) -> dict[str, Any]:
    dtype = onnx.TensorProto.DataType.Name(init.data_type)
    numel = 1
    for dim in init.dims:
        numel *= int(dim)
    if dtype in _SUB_BYTE_BITS:
        expected = (numel * _SUB_BYTE_BITS[dtype] + 7) // 8
    else:
        expected = numel * onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
    entry: dict[str, Any] = {"name": init.name, "dtype": dtype, "bytes": expected, "location": None}
    if init.data_location == _EXTERNAL:
        meta = {item.key: item.value for item in init.external_data}
        entry["location"] = meta.get("location")
        entry["offset"] = _count(meta.get("offset", 0))
        entry["length"] = _count(meta["length"]) if "length" in meta else expected
        entry["path"] = directory / str(meta.get("location", ""))
    return entry


def _count(value: Any) -> int:
    """An external-data offset or length; a malformed one counts as ``-1`` (never satisfiable)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def _external(initializers: list[dict[str, Any]], path: Path) -> Iterator[Finding]:
    rule = RULES["onnx-external-data"]
    sizes: dict[Path, int | None] = {}
    for init in initializers:
        if init["location"] is None:
            continue
        escape = escape_problem(path.parent, str(init["location"]), follow_links=True)
        if escape is not None:
            yield RULES["onnx-external-data-path"].finding(
                init["name"],
                f"initializer {init['name']} of {path.name} is stored in {escape}: it names a "
                "file outside the model's directory (onnxruntime refuses it: 'External data "
                "path escapes model directory'). Keep external data next to the .onnx file, "
                "named by a relative path, as a regular file",
                location=init["location"],
            )
            continue
        file: Path = init["path"]
        if file not in sizes:
            sizes[file] = file.stat().st_size if file.is_file() else None
        size, end = sizes[file], init["offset"] + init["length"]
        if size is None:
            yield rule.finding(
                init["name"],
                f"initializer {init['name']} is stored in {init['location']!r}, which does not "
                f"exist next to {path.name}: onnxruntime fails to load the model. Copy the "
                "external-data file along with the .onnx file",
                location=init["location"],
            )
        elif size < end or min(init["offset"], init["length"]) < 0:
            yield rule.finding(
                init["name"],
                f"initializer {init['name']} needs bytes {init['offset']}..{end} of "
                f"{init['location']!r}, which has {size}: the file is truncated",
                location=init["location"],
            )


def _opset(initializers: list[dict[str, Any]], opset: int | None, file: str) -> Iterator[Finding]:
    needs = {
        i["dtype"]: QUANTIZED_ONNX_DTYPES[i["dtype"]]
        for i in initializers
        if i["dtype"] in QUANTIZED_ONNX_DTYPES
    }
    for dtype, needed in sorted(needs.items()):
        if opset is None or opset < needed:
            yield RULES["onnx-opset"].finding(
                file,
                f"{file} imports default-domain opset {opset}, but holds {dtype} initializers, "
                f"which DequantizeLinear takes from opset {needed}: onnxruntime rejects the "
                f"model. Export with opset >= {needed}",
                opset=opset,
                needed=needed,
            )


def _nodes(graph: Any) -> Iterator[Any]:
    """Every node of ``graph`` and of the subgraphs its nodes hold (``If``, ``Loop``, ``Scan``)."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.HasField("g"):
                yield from _nodes(attribute.g)
            for sub in attribute.graphs:
                yield from _nodes(sub)


def _ops(onnx: Any, model: Any) -> Iterator[tuple[str, str, str]]:
    """``onnx-custom-op``: operators onnxruntime has no kernel or local function for."""
    local = {(f.domain, f.name) for f in model.functions}
    seen: set[tuple[str, str]] = set()
    nodes = [*_nodes(model.graph), *(n for f in model.functions for n in f.node)]
    for node in nodes:
        op = (node.domain, node.op_type)
        if op in seen or op in local:
            continue
        seen.add(op)
        domain, name = op
        if domain not in ONNXRUNTIME_DOMAINS:
            why = f"custom domain {domain!r}, which onnxruntime ships no kernels for"
        elif domain in _SCHEMA_DOMAINS and not onnx.defs.has(name, domain):
            why = f"no operator {name!r} in the standard domain {domain or 'ai.onnx'!r}"
        else:
            continue
        yield (
            "onnx-custom-op",
            f"{domain}:{name}" if domain else name,
            f"node {node.name or '?'} is operator {name!r} in {why}: onnxruntime refuses the "
            "model ('is not a registered function/op'), and running it would need a custom-op "
            "library, native code exportlm never loads. Export with standard operators",
        )


def onnx_load_problems(path: Path) -> list[tuple[str, str, str]]:
    """``(rule, subject, message)`` of what makes onnxruntime refuse ONNX file ``path``.

    Every error-level ONNX rule (``onnx-custom-op``, ``onnx-external-data-path``,
    ``onnx-external-data``, ``onnx-opset``, ``onnx-unreadable``): the ``onnx`` runtime
    raises these as an exportlm error instead of onnxruntime's. Needs ``onnx``.
    """
    findings, _ = onnx_findings(path)
    return [(f.rule, f.subject, f.message) for f in findings if f.severity is Severity.ERROR]
