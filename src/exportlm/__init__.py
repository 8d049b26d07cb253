"""exportlm: export decoder LMs through pluggable export targets and per-module exporters.

Public facade. Heavy libraries (torch, transformers, onnx) are imported lazily,
so ``import exportlm`` is cheap.
"""

from __future__ import annotations

from typing import Any

from exportlm._version import __version__
from exportlm.errors import (
    ExportError,
    ExportFailedError,
    ExportLMError,
    InvalidInputError,
    InvalidModelError,
    MissingDependencyError,
    OutputExistsError,
    PluginLoadError,
    QuantizationError,
    RegistryConflictError,
    RegistryError,
    RuntimeUnavailableError,
    TiedWeightsError,
    UnclaimedModuleError,
    UnknownNameError,
    UnknownOptionError,
    UnsupportedFormatError,
)
from exportlm.registry import Registry, RegistryEntry, load_entry_point_registry

__all__ = [
    "ExportError",
    "ExportFailedError",
    "InvalidInputError",
    "InvalidModelError",
    "ExportLMError",
    "MissingDependencyError",
    "OutputExistsError",
    "PluginLoadError",
    "QuantizationError",
    "Registry",
    "RegistryConflictError",
    "RegistryEntry",
    "RegistryError",
    "RuntimeUnavailableError",
    "TiedWeightsError",
    "UnclaimedModuleError",
    "UnknownNameError",
    "UnknownOptionError",
    "UnsupportedFormatError",
    "__version__",
    "export_model",
    "load_exported",
    "load_entry_point_registry",
]


def export_model(name: str, model: Any, output_path: Any, **kwargs: Any) -> Any:
    """Export ``model`` with target ``name``; see :func:`exportlm.export.export_model`."""
    from exportlm.export import export_model as _export_model

    return _export_model(name, model, output_path, **kwargs)


def load_exported(name: str, path: Any, **kwargs: Any) -> Any:
    """Load an artifact in its target's runtime; see :func:`exportlm.export.load_exported`."""
    from exportlm.export import load_exported as _load_exported

    return _load_exported(name, path, **kwargs)
