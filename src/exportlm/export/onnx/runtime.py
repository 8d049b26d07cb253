"""The ``onnx`` runtime: an ONNX artifact in onnxruntime, called as ``input_ids -> logits``.

onnxruntime is optional (the ``onnx`` extra): it is imported when an artifact
is loaded, and :func:`load_onnx` raises :class:`~exportlm.errors.MissingDependencyError`
without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from exportlm.errors import InvalidInputError, InvalidModelError, RuntimeUnavailableError
from exportlm.export._optional import require_modules
from exportlm.export.onnx._io import INPUT_NAMES, OUTPUT_NAMES
from exportlm.export.runtime import check_runtime_inputs

__all__ = ["OnnxRuntimeModel", "load_onnx"]


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

    Raises:
        MissingDependencyError: onnxruntime is not installed: ``pip install 'exportlm[onnx]'``.
        FileNotFoundError: no file at ``artifact``.
        RuntimeUnavailableError: ``device="cuda"`` without onnxruntime's CUDA provider.
        InvalidModelError: the graph's inputs are not the ones exportlm writes.
    """
    require_modules(
        "onnxruntime", extra="onnx", purpose="loading an artifact with the 'onnx' runtime"
    )
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
