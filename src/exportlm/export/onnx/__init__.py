"""The built-in ``onnx`` export target, its onnxruntime runtime, and the stable ONNX API.

Stable API (kept across releases; also importable from :mod:`exportlm.export`):

* :func:`export_to_onnx` ``(model, path, **options) -> Path``
* :func:`verify_onnx` ``(path, model, example_inputs=None, *, atol, rtol) -> OnnxVerification``
* :func:`get_onnx_info` ``(path) -> OnnxInfo``
* :func:`build_onnx_exporter` ``() -> factory``: the declared ``onnx`` export factory

The target itself, :func:`export_onnx_target`, is what ``export_model("onnx", ...)``
calls; :func:`load_onnx` is its runtime.

``onnx``, ``onnxruntime`` and ``onnxscript`` are optional (``pip install
'exportlm[onnx]'``). Importing this package needs none of them: the target stays
registered and listed, and exporting, loading, verifying or inspecting raises
:class:`~exportlm.errors.MissingDependencyError` naming what is missing.

One concern per module: :mod:`~exportlm.export.onnx.export` (the target),
:mod:`~exportlm.export.onnx.runtime`, :mod:`~exportlm.export.onnx.info`,
:mod:`~exportlm.export.onnx.verify`.
"""

from exportlm.export.onnx._legacy import LegacyTraceWarning
from exportlm.export.onnx.export import (
    DEFAULT_OPSET,
    ONNX_ATOL,
    ONNX_RTOL,
    build_onnx_exporter,
    export_onnx_target,
    export_to_onnx,
)
from exportlm.export.onnx.info import (
    OnnxInfo,
    OnnxQuantizedInitializer,
    OnnxValueInfo,
    get_onnx_info,
)
from exportlm.export.onnx.runtime import OnnxRuntimeModel, load_onnx
from exportlm.export.onnx.verify import OnnxVerification, verify_onnx

__all__ = [
    "DEFAULT_OPSET",
    "ONNX_ATOL",
    "ONNX_RTOL",
    "LegacyTraceWarning",
    "OnnxInfo",
    "OnnxQuantizedInitializer",
    "OnnxRuntimeModel",
    "OnnxValueInfo",
    "OnnxVerification",
    "build_onnx_exporter",
    "export_onnx_target",
    "export_to_onnx",
    "get_onnx_info",
    "load_onnx",
    "verify_onnx",
]
