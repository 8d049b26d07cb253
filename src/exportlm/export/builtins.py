"""The four built-in targets and their runtimes, registered in code by one function.

``onnx``, ``torchscript``, ``torch_export`` and ``hf_checkpoint`` are registered the
same way, as built-ins: they resolve with no entry-point metadata at all and under
``EXPORTLM_DISABLE_PLUGINS=1``, and an entry point that claims one of their names is a
conflict. Importing this module imports no ONNX package (see :mod:`~exportlm.export.onnx`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from exportlm.export.declaration import TargetInfo, declared_info
from exportlm.export.hf_checkpoint.runtime import load_hf_checkpoint
from exportlm.export.hf_checkpoint.target import export_hf_checkpoint
from exportlm.export.onnx.export import export_onnx_target
from exportlm.export.onnx.runtime import load_onnx
from exportlm.export.torch_export import export_torch_export, load_torch_export
from exportlm.export.torchscript import export_torchscript, load_torchscript
from exportlm.registry import Registry

__all__ = ["BUILTIN_TARGETS", "register_builtin_targets"]

#: (export factory, runtime loader) of every built-in target, in ``exportlm list`` order.
BUILTIN_TARGETS: tuple[tuple[Callable[..., Any], Callable[..., Any]], ...] = (
    (export_hf_checkpoint, load_hf_checkpoint),
    (export_onnx_target, load_onnx),
    (export_torch_export, load_torch_export),
    (export_torchscript, load_torchscript),
)


def _info(factory: Callable[..., Any]) -> TargetInfo:
    info = declared_info(factory)
    if info is None:  # pragma: no cover - every built-in is declared
        raise TypeError(f"built-in export factory {factory!r} has no target declaration")
    return info


def register_builtin_targets(
    exports: Registry[Callable[..., Any]], runtimes: Registry[Callable[..., Any]]
) -> None:
    """Register every built-in target in ``exports`` and its runtime in ``runtimes``."""
    for factory, loader in BUILTIN_TARGETS:
        info = _info(factory)
        exports.register(info.name, factory, builtin=True)
        runtimes.register(info.runtime, loader, builtin=True)
