"""A temporarily registered checkpoint target that writes ``hf_checkpoint``'s output, then a fault.

For the tests that prove a check fails on a broken third-party checkpoint writer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from exportlm.export import EXPORT_REGISTRY, ensure_exporters_registered, export_target
from exportlm.export.hf_checkpoint import export_hf_checkpoint


@contextmanager
def checkpoint_target(name: str, export: Callable[..., Path], **declaration: Any) -> Iterator[str]:
    """Register ``export`` as target ``name``, declared as ``hf_checkpoint`` is.

    ``quantized`` and ``multi_file`` capabilities, a directory artifact, the
    ``hf_checkpoint`` runtime, its tolerance; ``declaration`` adds to or overrides
    the keywords of :func:`~exportlm.export.export_target`. Unregistered on exit.
    """
    ensure_exporters_registered()
    keywords: dict[str, Any] = {
        "runtime": "hf_checkpoint",
        "atol": 1e-4,
        "rtol": 1e-3,
        "capabilities": {"quantized", "multi_file"},
        "artifact": "directory",
        **declaration,
    }
    EXPORT_REGISTRY.register(name, export_target(name, **keywords)(export))
    try:
        yield name
    finally:
        EXPORT_REGISTRY.unregister(name)


@contextmanager
def faulty_checkpoint_target(name: str, fault: Callable[[Path], None]) -> Iterator[str]:
    """Register target ``name``: the ``hf_checkpoint`` export, then ``fault(directory)``.

    It declares what ``hf_checkpoint`` declares (:func:`checkpoint_target`); it is
    unregistered on exit.
    """

    def export(model: Any, output_path: Path, *, example_inputs: Any = None) -> Path:
        out = Path(export_hf_checkpoint(model, output_path))
        fault(out)
        return out

    with checkpoint_target(name, export) as registered:
        yield registered
