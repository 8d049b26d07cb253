"""What kind of artifact a path is, in the terms of the engines' support tables.

:func:`artifact_kind` reads only configs (never weights, never code): a checkpoint
directory's ``config.json`` (its ``quantization_config``, through the checkpoint room's
one reader, :func:`exportlm.checkpoint.declaration_of`), or an ONNX file's name.
The result is what :meth:`Engine.support` takes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exportlm.checkpoint import declaration_of
from exportlm.hfdir import read_config, read_json_object

__all__ = ["ArtifactKind", "artifact_kind"]


@dataclass(frozen=True)
class ArtifactKind:
    """An artifact as the support tables name it (see :class:`~exportlm.engines.Support`)."""

    target: str
    layout: str | None
    scheme: str | None
    dtype: str
    #: a checkpoint's ``config.json`` ``model_type`` (``None`` for an ONNX graph)
    model_type: str | None = None


def _checkpoint_kind(config: Mapping[str, Any]) -> ArtifactKind:
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    model_type = config.get("model_type")
    arch = str(model_type) if model_type is not None else None
    declared = declaration_of(config).config  # config.json's own: what engines dispatch on
    if declared is None or declared.empty:
        return ArtifactKind("hf_checkpoint", None, None, dtype, arch)
    return ArtifactKind("hf_checkpoint", str(declared.quant_method), declared.scheme, dtype, arch)


#: What the ONNX target writes beside a graph ``model.onnx``: ``model.onnx.manifest.json``.
_MANIFEST_SUFFIX = ".manifest.json"


def _onnx_in(folder: Path) -> Path | None:
    graphs = sorted(folder.glob("*.onnx"))
    return graphs[0] if len(graphs) == 1 else None


def _onnx_layout(graph: Path) -> str:
    """``"kv_cache"`` when the graph's manifest records ``kv_cache=True``, else ``"plain"``.

    Read as plain JSON (no signature check: the engines decide nothing from it but which
    support-table row to look up; the comparison itself decides the outcome).
    """
    manifest = graph.with_name(graph.name + _MANIFEST_SUFFIX)
    try:  # bounded, and a FIFO or device refused (ValueError) before it is read
        options = read_json_object(manifest, what="ONNX manifest").get("options") or {}
    except (OSError, ValueError):
        return "plain"
    return "kv_cache" if isinstance(options, dict) and options.get("kv_cache") else "plain"


def artifact_kind(path: str | os.PathLike[str]) -> ArtifactKind:
    """The kind of the artifact at ``path``: a checkpoint directory or an ``.onnx`` file.

    An ONNX file is ``ArtifactKind("onnx", layout, None, "float32")`` with layout
    ``"kv_cache"`` when its manifest records ``kv_cache=True``, else ``"plain"``; a
    folder holding one ``.onnx`` graph and a ``config.json`` (Optimum's layout) is
    that graph.
    Raises ``ValueError`` for anything else, and what
    :func:`exportlm.hfdir.read_config` raises for a malformed ``config.json``.
    """
    artifact = Path(path)
    if artifact.is_dir() and (artifact / "config.json").is_file() and _onnx_in(artifact):
        artifact = _onnx_in(artifact) or artifact  # an Optimum / genai folder: its graph
    if artifact.is_dir():
        return _checkpoint_kind(read_config(artifact))
    if artifact.suffix == ".onnx":
        return ArtifactKind("onnx", _onnx_layout(artifact), None, "float32")
    raise ValueError(f"{artifact}: neither a checkpoint directory nor an .onnx file")
