"""The ``onnx`` runtime: an ONNX artifact in onnxruntime, called as ``input_ids -> logits``.

A past-key-values graph (exported with ``kv_cache=True``) loads as an
:class:`OnnxGenerationRuntime`, which also has ``prefill`` and ``decode`` steps;
it feeds the graph's ``attention_mask`` and ``position_ids`` inputs (when it has
them) from the caller's padding mask, as Optimum does.

onnxruntime is optional (the ``onnx`` extra): it is imported when an artifact
is loaded, and :func:`load_onnx` raises :class:`~exportlm.errors.MissingDependencyError`
without it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from exportlm.errors import (
    ExportLMError,
    InvalidInputError,
    InvalidModelError,
    MalformedOnnxError,
    RuntimeUnavailableError,
)
from exportlm.export._optional import require_modules
from exportlm.export._past import PastLayout, flat_past_names
from exportlm.export.generation import PastStepRuntime
from exportlm.export.onnx._io import INPUT_NAMES, OUTPUT_NAMES
from exportlm.export.onnx._past import PAST_PREFIX, PRESENT_PREFIX
from exportlm.export.runtime import check_runtime_inputs
from exportlm.inspection import check_onnx_size

__all__ = ["OnnxGenerationRuntime", "OnnxRuntimeModel", "load_onnx"]


class OnnxRuntimeModel:
    """An ONNX artifact loaded in onnxruntime, called as ``input_ids -> logits``.

    An ``attention_mask`` graph input is fed with ones (no padding).

    Attributes:
        session: the ``onnxruntime.InferenceSession``.
        path: the loaded ``.onnx`` file.
        input_names: the graph's input names.
        vocab_size: the vocabulary (the logits' static last dim), when the graph fixes it.
    """

    def __init__(self, session: Any, path: Path) -> None:
        self.session = session
        self.path = path
        self.input_names = [i.name for i in session.get_inputs()]
        vocab = session.get_outputs()[0].shape[-1] if session.get_outputs() else None
        #: The logits' static last dim: ids at or above it are refused.
        self.vocab_size: int | None = vocab if isinstance(vocab, int) else None
        unknown = [n for n in self.input_names if n not in INPUT_NAMES]
        if not self.input_names or self.input_names[0] != "input_ids" or unknown:
            raise InvalidModelError(
                f"{path}: graph inputs {self.input_names}; the onnx runtime feeds "
                f"'input_ids' first and optionally 'attention_mask', nothing else. "
                "Export with exportlm, or run the file with onnxruntime directly"
            )

    def __call__(self, input_ids: Any) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` (float32, CPU) for ``input_ids`` ``[batch, seq]``."""
        ids = check_runtime_inputs(input_ids, "onnx", self.vocab_size).cpu().numpy()
        feed = {"input_ids": ids}
        if "attention_mask" in self.input_names:
            feed["attention_mask"] = np.ones_like(ids)
        (logits,) = self.session.run(list(OUTPUT_NAMES), feed)
        return torch.from_numpy(logits)

    def __repr__(self) -> str:
        return f"OnnxRuntimeModel({str(self.path)!r}, providers={self.session.get_providers()})"


#: onnxruntime's element type names of the past tensors, and their torch dtypes.
_PAST_DTYPES = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16}


#: Inputs a past-key-values graph may take between ``input_ids`` and the past, in order.
_STEP_INPUTS = ("attention_mask", "position_ids")


def _past_layout(session: Any, path: Path) -> tuple[PastLayout, tuple[str, ...]]:
    """The layout of a past-key-values graph and its mask / position inputs (or InvalidModelError)."""
    inputs = session.get_inputs()
    names = [i.name for i in inputs]
    extra = tuple(n for n in _STEP_INPUTS if n in names)
    past = inputs[1 + len(extra) :]
    layers = len(past) // 2
    expected = ["input_ids", *extra, *flat_past_names(layers, PAST_PREFIX)]
    outputs = [o.name for o in session.get_outputs()]
    heads: list[tuple[int, int]] = []
    for value in past[::2]:
        shape = value.shape
        if len(shape) == 4 and isinstance(shape[1], int) and isinstance(shape[3], int):
            heads.append((shape[1], shape[3]))
    dtype = _PAST_DTYPES.get(past[0].type) if past else None
    if (
        names != expected
        or extra == ("position_ids",)
        or outputs != ["logits", *flat_past_names(layers, PRESENT_PREFIX)]
        or len(heads) != layers
        or dtype is None
    ):
        raise InvalidModelError(
            f"{path}: graph inputs {names} and outputs {outputs} are not the past-key-values "
            f"interface exportlm writes (input_ids, optionally attention_mask and position_ids, "
            f"{PAST_PREFIX}.{{i}}.key/value [batch, kv_heads, past_sequence, head_dim] float -> "
            f"logits, {PRESENT_PREFIX}.{{i}}.key/value); export with kv_cache=True, or run the "
            "file with onnxruntime directly"
        )
    return PastLayout(tuple(heads), dtype, "tuple", PAST_PREFIX), extra


class OnnxGenerationRuntime(PastStepRuntime):
    """A past-key-values ONNX graph in onnxruntime: ``input_ids -> logits``, ``prefill``, ``decode``.

    Attributes:
        session: the ``onnxruntime.InferenceSession``.
        path: the loaded ``.onnx`` file.
    """

    def __init__(self, session: Any, path: Path) -> None:
        vocab = session.get_outputs()[0].shape[-1]
        layout, extra = _past_layout(session, path)
        super().__init__(layout, "onnx", vocab if isinstance(vocab, int) else None)
        self.takes_mask = "attention_mask" in extra
        self.takes_positions = "position_ids" in extra
        self.session = session
        self.path = path
        self._inputs = [i.name for i in session.get_inputs()]
        self._outputs = [o.name for o in session.get_outputs()]

    def _step(
        self, input_ids: torch.Tensor, past: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self._feed([input_ids, *past])

    def _masked_step(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None,
        past: list[torch.Tensor],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        extra = [attention_mask] + ([position_ids] if position_ids is not None else [])
        return self._feed([input_ids, *extra, *past])

    def _feed(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        arrays = [t.cpu().numpy() for t in tensors]
        outputs = self.session.run(self._outputs, dict(zip(self._inputs, arrays, strict=True)))
        results = [torch.from_numpy(np.ascontiguousarray(o)) for o in outputs]
        return results[0], results[1:]

    def __repr__(self) -> str:
        return (
            f"OnnxGenerationRuntime({str(self.path)!r}, layers={self.layout.num_layers}, "
            f"providers={self.session.get_providers()})"
        )


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


def _refuse_unloadable(path: Path) -> None:
    """Raise what onnxruntime would refuse in ``path`` as an exportlm error (needs ``onnx``).

    The rules are ``exportlm inspect``'s (:func:`exportlm.inspection.onnx_load_problems`):
    a custom-domain operator, external data outside the directory (by name or link),
    missing or truncated external data, an opset too old for the initializers' dtypes.
    """
    if importlib.util.find_spec("onnx") is None:  # onnxruntime alone: its own errors, wrapped
        return
    from exportlm.inspection import onnx_load_problems

    problems = onnx_load_problems(path)
    if problems:
        rule, subject, message = problems[0]
        raise MalformedOnnxError(
            f"{path}: {message} (rule {rule}: docs/checkpoint-rules.md#{rule})",
            path=path,
            field=subject,
        )


def load_onnx(
    artifact: Path,
    *,
    device: str = "cpu",
    providers: Sequence[str] | None = None,
    intra_op_num_threads: int | None = None,
) -> OnnxRuntimeModel | OnnxGenerationRuntime:
    """Load an ONNX artifact in onnxruntime; returns ``input_ids -> logits`` (a torch tensor).

    A past-key-values graph (``kv_cache=True``) loads as an :class:`OnnxGenerationRuntime`,
    which also has ``prefill`` / ``decode``.

    Args:
        artifact: the ``.onnx`` file (external data is found beside it).
        device: ``"cpu"`` or ``"cuda"`` (needs onnxruntime-gpu).
        providers: explicit onnxruntime execution providers; overrides ``device``.
        intra_op_num_threads: onnxruntime's CPU thread pool size; default: torch's
            ``torch.get_num_threads()``, so a process that limited torch's threads
            (e.g. one per xdist worker) does not get an onnxruntime spinning on
            every core beside it.

    Raises:
        MissingDependencyError: onnxruntime is not installed: ``pip install 'exportlm[onnx]'``.
        FileNotFoundError: no file at ``artifact``.
        RuntimeUnavailableError: ``device="cuda"`` without onnxruntime's CUDA provider.
        InvalidModelError: the graph's inputs are not the ones exportlm writes.
        MalformedOnnxError: onnxruntime would refuse the file (``exportlm inspect``'s
            error-level ONNX rules: a custom-domain operator, external data outside the
            model's directory, ...), or refused it.
        InputTooLargeError: a file over 2 GiB (protobuf's limit), refused before it is read.
    """
    require_modules(
        "onnxruntime", extra="onnx", purpose="loading an artifact with the 'onnx' runtime"
    )
    import onnxruntime as ort

    path = Path(artifact)
    if not path.is_file():
        raise FileNotFoundError(f"onnx runtime: no ONNX file at {path}")
    check_onnx_size(path)  # onnxruntime would read a sparse 16 GiB file whole
    options = ort.SessionOptions()
    options.log_severity_level = 4  # failures raise with the message; no duplicate stderr lines
    options.intra_op_num_threads = intra_op_num_threads or torch.get_num_threads()
    chosen = _providers(device, providers)
    _refuse_unloadable(path)
    try:
        session = ort.InferenceSession(str(path), sess_options=options, providers=chosen)
    except Exception as err:  # onnxruntime's Fail / InvalidGraph / ...: the file's defect
        if isinstance(err, (MemoryError, ExportLMError)):
            raise
        raise MalformedOnnxError(
            f"{path}: onnxruntime cannot load it ({type(err).__name__}: {err}); run "
            f"'exportlm inspect {path}' to see which rule it breaks, or export it again",
            path=path,
        ) from err
    if any(i.name.startswith(f"{PAST_PREFIX}.") for i in session.get_inputs()):
        return OnnxGenerationRuntime(session, path)
    return OnnxRuntimeModel(session, path)
