"""The built-in ``onnx`` export target, its onnxruntime runtime, and the stable ONNX API.

Stable API (kept across releases):

* :func:`export_to_onnx` ``(model, path, **options) -> Path``
* :func:`verify_onnx` ``(path, model, example_inputs=None, *, atol, rtol) -> OnnxVerification``
* :func:`get_onnx_info` ``(path) -> OnnxInfo``

The target itself, :func:`export_onnx_target`, is what ``export_model("onnx", ...)``
calls; :func:`load_onnx` is its runtime.

Design notes (measured with torch 2.13 CPU, transformers 5.24, onnxruntime 1.32):

* The dynamo exporter (default) keeps batch and sequence symbolic. The legacy
  TorchScript-based exporter (``dynamo=False``) is ~15x faster but bakes
  shape-dependent Python values into the graph: on a plain ``nn.MultiheadAttention``
  decoder the result fails in onnxruntime at any other sequence length. It is
  offered honestly: when the trace recorded such values a single
  :class:`LegacyTraceWarning` says so.
* transformers models get an explicit ``attention_mask`` graph input: the legacy
  exporter fails on ``aten::diff`` in transformers-5 masking without one, and with
  it both exporters produce graphs that honour padding. The runtime feeds ones.
* Opset 23 with dynamic shapes emits a ``RotaryEmbedding`` node that onnxruntime
  1.32 rejects; 18-22 work, the default is :data:`DEFAULT_OPSET`.
* External data is written only when the weights exceed protobuf's 2 GiB limit,
  so a small model is one self-contained ``.onnx`` file.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from exportlm.errors import InvalidInputError, InvalidModelError
from exportlm.export._base import export_target
from exportlm.export._compare import compare_logits
from exportlm.export._moe import traceable_model
from exportlm.export._quiet import CapturedNoise, warn_caller
from exportlm.export._session import (
    ExportJob,
    RuntimeUnavailableError,
    check_runtime_inputs,
    export_session,
)
from exportlm.export._wrapper import ExportCacheWrapper, accepts_attention_mask
from exportlm.inputs import resolve_example_inputs

__all__ = [
    "DEFAULT_OPSET",
    "ONNX_ATOL",
    "ONNX_RTOL",
    "LegacyTraceWarning",
    "OnnxInfo",
    "OnnxRuntimeModel",
    "OnnxValueInfo",
    "OnnxVerification",
    "export_onnx_target",
    "export_to_onnx",
    "get_onnx_info",
    "load_onnx",
    "verify_onnx",
]

#: Default ONNX opset: inside the 18-22 range that both exporters and onnxruntime 1.32 handle
#: with dynamic shapes (23 emits RotaryEmbedding, which onnxruntime rejects); >= 19 keeps
#: FLOAT8 initializers for quantized graphs.
DEFAULT_OPSET = 20
_MAX_TESTED_OPSET = 22

# Tolerance: the onnxruntime CPU kernels reorder float32 reductions. Measured max |diff| of
# logits vs eager: 6e-8..1.2e-7 on the tiny toy/HF models (dynamo and legacy alike) and 2e-6 on
# a 58M-parameter Llama; the MoE models additionally differ by the batched_mm experts kernel
# used for export (~1e-7). 1e-4 absolute leaves a 50x margin over the largest measurement while
# still failing any real graph error (those are >= 1e-2 on logits of magnitude ~1).
ONNX_ATOL = 1e-4
ONNX_RTOL = 1e-4

#: Above this many bytes of weights, protobuf cannot hold the model: use external data.
_PROTOBUF_LIMIT = 2**31

_INPUT_NAMES = ("input_ids", "attention_mask")
_OUTPUT_NAMES = ["logits"]
_AXES = {0: "batch", 1: "sequence"}


class LegacyTraceWarning(UserWarning):
    """The legacy ONNX exporter baked shape-dependent values into the graph (one per export)."""


def _onnx_cuda_available() -> bool:
    """Whether onnxruntime's CUDA execution provider is installed.

    Read from package metadata: importing onnxruntime to ask costs ~0.1 s and
    ~13 MB in every process that merely registers the targets.
    """
    from importlib import metadata

    try:
        metadata.distribution("onnxruntime-gpu")
    except metadata.PackageNotFoundError:
        return False
    return True


_CAPABILITIES = {"dynamic_shapes", "multi_file"} | ({"cuda"} if _onnx_cuda_available() else set())


# ----------------------------------------------------------------------------- export


def _is_transformers_model(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None)
    return isinstance(base, type) and isinstance(model, base)


def _weight_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def _export_args(
    job: ExportJob, attention_mask: bool | None
) -> tuple[ExportCacheWrapper, tuple[torch.Tensor, ...], list[str]]:
    """The wrapper, positional args and input names for one export."""
    wants_mask = (
        attention_mask
        if attention_mask is not None
        else _is_transformers_model(job.model) and accepts_attention_mask(job.model)
    )
    if wants_mask and not accepts_attention_mask(job.model):
        raise InvalidModelError(
            f"attention_mask=True but {type(job.model).__name__}.forward takes no "
            "attention_mask argument; pass attention_mask=False"
        )
    ids = job.inputs[0]
    wrapper = ExportCacheWrapper(job.model).eval()
    if wants_mask:
        mask = job.inputs[1] if len(job.inputs) > 1 else torch.ones_like(ids)
        return wrapper, (ids, mask), list(_INPUT_NAMES)
    return wrapper, (ids,), list(_INPUT_NAMES[:1])


@contextlib.contextmanager
def _legacy_graph_log_captured(noise: CapturedNoise) -> Iterator[None]:
    """Route the legacy exporter's C++ graph log into ``noise`` and undo its global switch.

    torch 2.13's ``setup_onnx_logging`` tests ``_C._jit_is_onnx_log_enabled`` without
    calling it, so every legacy export turns the ONNX log on for the rest of the process
    and a failing export dumps the whole TorchScript graph to stderr from C++, past any
    Python-level redirection. Both hooks are private; without them this does nothing.
    """
    c_api: Any = torch._C
    log = getattr(c_api, "_jit_onnx_log", None)
    is_enabled = getattr(c_api, "_jit_is_onnx_log_enabled", None)
    set_enabled = getattr(c_api, "_jit_set_onnx_log_enabled", None)
    if not (callable(log) and callable(is_enabled) and callable(set_enabled)):
        yield
        return
    was_enabled = bool(is_enabled())

    def capture(*parts: Any) -> None:
        noise.stderr += "".join(str(part) for part in parts) + "\n"

    c_api._jit_onnx_log = capture
    try:
        yield
    finally:
        c_api._jit_onnx_log = log
        set_enabled(was_enabled)


def _consolidate_external_data(path: Path) -> None:
    """Store every weight of ``path`` in one ``<file>.data`` beside it.

    The legacy exporter ignores ``external_data=True`` below 2 GiB and, above it,
    writes one file per tensor; the dynamo exporter writes ``<file>.data``. This
    gives legacy artifacts the same layout. ``path`` is the staged file, alone in
    its staging directory, so every other file there is one of its tensors.
    """
    import onnx

    proto = onnx.load(str(path), load_external_data=True)
    for stray in path.parent.iterdir():
        if stray != path:
            stray.unlink()
    onnx.save_model(
        proto,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=f"{path.name}.data",
        size_threshold=0,
    )


def _warn_legacy_trace(job: ExportJob, dynamic: bool) -> None:
    tracer = [w for w in job.noise.warnings if w.category.__name__ == "TracerWarning"]
    if not (dynamic and tracer):
        return
    first = tracer[0]
    warn_caller(
        LegacyTraceWarning(
            f"the legacy ONNX exporter (dynamo=False) recorded {len(tracer)} shape-dependent "
            f"Python value(s) as constants (first at {first.filename}:{first.lineno}: "
            f"{str(first.message).splitlines()[0]}); the graph may only run at the traced shape "
            f"{tuple(job.inputs[0].shape)}. Use dynamo=True (the default) for dynamic batch and "
            "sequence, or check other shapes with verify_onnx(..., example_inputs=...)."
        )
    )


@export_target(
    "onnx",
    runtime="onnx",
    atol=ONNX_ATOL,
    rtol=ONNX_RTOL,
    capabilities=_CAPABILITIES,
    artifact="file",
    suffix=".onnx",
    description="ONNX graph (torch.onnx dynamo exporter, dynamic batch/seq) run in onnxruntime",
)
def export_onnx_target(
    model: nn.Module,
    output_path: Path,
    *,
    example_inputs: Any = None,
    opset: int = DEFAULT_OPSET,
    dynamo: bool = True,
    dynamic: bool = True,
    optimize: bool = True,
    external_data: bool | None = None,
    attention_mask: bool | None = None,
) -> Path:
    """Export ``model`` to an ONNX file at ``output_path``; returns the path.

    Args:
        model: any ``nn.Module`` whose ``forward(input_ids)`` returns logits,
            ``(logits, cache)`` or an object with ``.logits``. It is exported in eval
            mode with traceable MoE experts and restored afterwards.
        output_path: the ``.onnx`` file to write (atomically).
        example_inputs: ``input_ids`` [batch, seq] or a tuple ``(input_ids, attention_mask)``;
            default: deterministic ids [2, 8] from the model's vocabulary.
        opset: ONNX opset; 18-22 are tested with onnxruntime.
        dynamo: ``True`` uses ``torch.onnx``'s dynamo exporter; ``False`` the legacy
            TorchScript-based exporter (faster; may bake in the sequence length, see
            :class:`LegacyTraceWarning`).
        dynamic: symbolic ``batch`` and ``sequence`` axes on every input and the logits.
        optimize: run the onnxscript graph optimizer (dynamo only).
        external_data: write weights to ``<file>.data``; ``None`` (default) only when
            they exceed the 2 GiB protobuf limit.
        attention_mask: add an ``attention_mask`` graph input; ``None`` (default) does so
            for transformers models, whose masking needs it for the legacy exporter.

    Raises:
        InvalidModelError / InvalidInputError: the model or inputs do not fit.
        ExportFailedError: ``torch.onnx.export`` failed (the cause is chained).
    """
    if not isinstance(opset, int) or opset < 7:
        raise InvalidInputError(f"opset must be an int ONNX opset version (18-22), got {opset!r}")
    if opset > _MAX_TESTED_OPSET:
        warnings.warn(
            f"opset {opset} is above {_MAX_TESTED_OPSET}; onnxruntime 1.32 rejects the "
            "RotaryEmbedding node opset 23 emits with dynamic shapes",
            UserWarning,
            stacklevel=2,
        )
    hint = (
        "Try dynamo=True (the default)."
        if not dynamo
        else "Try dynamo=False (legacy exporter) or another opset in 18-22."
    )
    with export_session("onnx", model, output_path, example_inputs, hint=hint) as job:
        wrapper, args, names = _export_args(job, attention_mask)
        use_external = (
            external_data if external_data is not None else _weight_bytes(model) > _PROTOBUF_LIMIT
        )
        options: dict[str, Any] = {
            "input_names": names,
            "output_names": _OUTPUT_NAMES,
            "opset_version": opset,
            "dynamo": dynamo,
            "external_data": use_external,
            "verbose": False,
        }
        if dynamo:
            options["optimize"] = optimize
            if dynamic:
                # Names become Dim.DYNAMIC and then the graph's axis names. The mask's sequence
                # axis shares the ids' symbol, so it stays unnamed (naming it again warns).
                mask_axes = {0: _AXES[0], 1: torch.export.Dim.DYNAMIC}
                options["dynamic_shapes"] = {
                    name: dict(_AXES) if name == "input_ids" else mask_axes for name in names
                }
        elif dynamic:
            options["dynamic_axes"] = {name: dict(_AXES) for name in [*names, *_OUTPUT_NAMES]}
        # No torch.no_grad() here: under no_grad nn.MultiheadAttention takes its fused
        # fast path (aten::_native_multi_head_attention), which the legacy exporter rejects.
        with _legacy_graph_log_captured(job.noise) if not dynamo else contextlib.nullcontext():
            torch.onnx.export(wrapper, args, str(job.staged), **options)
        if not dynamo:
            if use_external:
                _consolidate_external_data(job.staged)
            _warn_legacy_trace(job, dynamic)
    return Path(output_path)


def export_to_onnx(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    example_inputs: Any = None,
    opset: int = DEFAULT_OPSET,
    dynamo: bool = True,
    dynamic: bool = True,
    optimize: bool = True,
    external_data: bool | None = None,
    attention_mask: bool | None = None,
) -> Path:
    """Export ``model`` to ONNX at ``path`` (stable API); see :func:`export_onnx_target`."""
    return export_onnx_target(
        model,
        Path(path),
        example_inputs=example_inputs,
        opset=opset,
        dynamo=dynamo,
        dynamic=dynamic,
        optimize=optimize,
        external_data=external_data,
        attention_mask=attention_mask,
    )


# ----------------------------------------------------------------------------- runtime


class OnnxRuntimeModel:
    """An ONNX artifact loaded in onnxruntime, called as ``input_ids -> logits``.

    An ``attention_mask`` graph input is fed with ones (no padding).

    Attributes:
        session: the ``onnxruntime.InferenceSession``.
        input_names: the graph's input names.
    """

    def __init__(self, session: Any, path: Path) -> None:
        self.session = session
        self.path = path
        self.input_names = [i.name for i in session.get_inputs()]
        unknown = [n for n in self.input_names if n not in _INPUT_NAMES]
        if not self.input_names or self.input_names[0] != "input_ids" or unknown:
            raise InvalidModelError(
                f"{path}: graph inputs {self.input_names}; the onnx runtime feeds "
                f"'input_ids' first and optionally 'attention_mask', nothing else. "
                "Export with exportlm, or run the file with onnxruntime directly"
            )

    def __call__(self, input_ids: Any) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` (float32, CPU) for ``input_ids`` ``[batch, seq]``."""
        ids = check_runtime_inputs(input_ids, "onnx").cpu().numpy()
        feed = {"input_ids": ids}
        if "attention_mask" in self.input_names:
            feed["attention_mask"] = np.ones_like(ids)
        (logits,) = self.session.run(_OUTPUT_NAMES, feed)
        return torch.from_numpy(logits)

    def __repr__(self) -> str:
        return f"OnnxRuntimeModel({str(self.path)!r}, providers={self.session.get_providers()})"


def _providers(device: str, providers: Sequence[str] | None) -> list[str]:
    import onnxruntime as ort

    if providers is not None:
        return list(providers)
    kind = device.split(":", 1)[0]
    if kind == "cpu":
        return ["CPUExecutionProvider"]
    if kind == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise RuntimeUnavailableError(
                f"onnx runtime: device {device!r} needs onnxruntime's CUDAExecutionProvider; "
                f"this onnxruntime has {ort.get_available_providers()}. Install onnxruntime-gpu "
                "or load with device='cpu'"
            )
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    raise InvalidInputError(f"onnx runtime: unknown device {device!r}; expected 'cpu' or 'cuda'")


def load_onnx(
    artifact: Path,
    *,
    device: str = "cpu",
    providers: Sequence[str] | None = None,
    intra_op_num_threads: int | None = None,
) -> OnnxRuntimeModel:
    """Load an ONNX artifact in onnxruntime; returns ``input_ids -> logits`` (a torch tensor).

    Args:
        artifact: the ``.onnx`` file (external data is found beside it).
        device: ``"cpu"`` or ``"cuda"`` (needs onnxruntime-gpu).
        providers: explicit onnxruntime execution providers; overrides ``device``.
        intra_op_num_threads: onnxruntime's CPU thread pool size; default: torch's
            ``torch.get_num_threads()``, so a process that limited torch's threads
            (e.g. one per xdist worker) does not get an onnxruntime spinning on
            every core beside it.
    """
    import onnxruntime as ort

    path = Path(artifact)
    if not path.is_file():
        raise FileNotFoundError(f"onnx runtime: no ONNX file at {path}")
    options = ort.SessionOptions()
    options.log_severity_level = 4  # failures raise with the message; no duplicate stderr lines
    options.intra_op_num_threads = intra_op_num_threads or torch.get_num_threads()
    session = ort.InferenceSession(
        str(path), sess_options=options, providers=_providers(device, providers)
    )
    return OnnxRuntimeModel(session, path)


# ----------------------------------------------------------------------------- inspection


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
    """
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


# ----------------------------------------------------------------------------- verification


@dataclass(frozen=True)
class OnnxVerification:
    """The result of :func:`verify_onnx`: structural check plus onnxruntime roundtrip vs eager.

    ``passed`` is true when the checker accepts the file, onnxruntime ran it, the
    shapes match and every logit satisfies ``|ort - eager| <= atol + rtol * |eager|``.
    ``error`` holds the checker or runtime failure, if any (then the diffs are NaN).
    """

    path: Path
    checker_ok: bool
    max_abs: float
    max_rel: float
    mismatch_fraction: float
    expected_shape: tuple[int, ...]
    actual_shape: tuple[int, ...]
    atol: float
    rtol: float
    passed: bool
    error: str | None = None

    def summary(self) -> str:
        """One line: verdict, max abs / rel diff and mismatch percentage."""
        verdict = "passed" if self.passed else "FAILED"
        text = (
            f"{self.path.name}: {verdict}: max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}, "
            f"{100 * self.mismatch_fraction:.3g}% beyond atol={self.atol:g} rtol={self.rtol:g}"
        )
        return text + (f" ({self.error})" if self.error else "")


def verify_onnx(
    path: str | os.PathLike[str],
    model: nn.Module,
    example_inputs: Any = None,
    *,
    atol: float = ONNX_ATOL,
    rtol: float = ONNX_RTOL,
    device: str = "cpu",
) -> OnnxVerification:
    """Check an ONNX file and compare its onnxruntime logits with ``model``'s eager logits.

    Returns a report; it never asserts. ``example_inputs`` (``input_ids``) default to
    the deterministic ids export uses; pass other shapes to check dynamic axes. The
    model is run in eval mode and restored.
    """
    import onnx

    file = Path(path)
    ids = resolve_example_inputs(model, example_inputs)[0]
    with traceable_model(model, experts=None), torch.no_grad():
        expected = ExportCacheWrapper(model)(ids).float().cpu()
    nan = float("nan")

    def failed(checker_ok: bool, error: str) -> OnnxVerification:
        return OnnxVerification(
            file, checker_ok, nan, nan, nan, tuple(expected.shape), (), atol, rtol, False, error
        )

    try:
        onnx.checker.check_model(str(file), full_check=False)
    except Exception as err:  # the checker raises ValidationError and friends
        return failed(False, f"onnx.checker: {type(err).__name__}: {err}")
    try:
        actual = load_onnx(file, device=device)(ids).float()
    except Exception as err:  # onnxruntime raises its own Fail / InvalidArgument classes
        return failed(True, f"onnxruntime: {type(err).__name__}: {err}")
    if actual.shape != expected.shape:
        return OnnxVerification(
            file,
            True,
            nan,
            nan,
            1.0,
            tuple(expected.shape),
            tuple(actual.shape),
            atol,
            rtol,
            False,
            "shape mismatch",
        )
    comparison = compare_logits(actual, expected, atol, rtol)
    return OnnxVerification(
        file,
        True,
        comparison.max_abs,
        comparison.max_rel,
        comparison.mismatch_pct / 100.0,
        tuple(expected.shape),
        tuple(actual.shape),
        atol,
        rtol,
        passed=comparison.passed,
    )
