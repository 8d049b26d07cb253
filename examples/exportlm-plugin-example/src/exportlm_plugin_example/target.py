"""Export target ``example_traced`` and its runtime.

The target traces the model behind :class:`exportlm.export.ExportCacheWrapper`
(so the graph is ``input_ids -> logits`` with no KV cache) and saves it with
``torch.jit.save``; the runtime loads it with ``torch.jit.load``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from exportlm.export import (
    ExportCacheWrapper,
    atomic_output,
    export_target,
    resolve_example_inputs,
)
from exportlm.export.guard import open_artifact

__all__ = ["export_traced", "load_traced"]


@contextlib.contextmanager
def _quiet_jit() -> Iterator[None]:
    """torch.jit is deprecated in recent torch; this example knows, and says it once here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=DeprecationWarning)
        warnings.simplefilter("ignore", category=FutureWarning)
        yield


@export_target(
    "example_traced",
    runtime="example_traced",
    atol=1e-5,
    rtol=1e-4,
    capabilities={"dynamic_shapes", "cuda"},
    artifact="file",
    executes_code=True,  # a TorchScript archive runs code when loaded
    suffix=".pt",
    # How the model is captured: toy families declare their failures per capture
    # (dbrx's data-dependent expert loop fails tracing), and this row inherits them.
    capture="torchscript-trace",
    # {check id, or pattern over item ids: reason}: failures of this target's own;
    # strict: a pass fails the run.
    expected_failures={},
    description="torch.jit.trace of the logits-only wrapper, saved with torch.jit.save",
)
def export_traced(model: torch.nn.Module, output_path: Path, *, example_inputs: Any = None) -> Path:
    """Trace ``model`` on ``example_inputs`` and save it atomically.

    The conformance suite calls factories without ``example_inputs``: ``None`` means
    deterministic ids ``[2, 8]`` from the model's vocabulary, on the model's device.
    """
    inputs = resolve_example_inputs(model, example_inputs)
    wrapped = ExportCacheWrapper(model).eval()
    with _quiet_jit(), torch.no_grad():
        traced = torch.jit.trace(wrapped, inputs, check_trace=False)
    # Write into a temporary sibling and move it into place only on success:
    # a failed export leaves no partial file and an existing artifact untouched.
    with atomic_output(output_path) as staged, _quiet_jit():
        torch.jit.save(traced, str(staged))
    return Path(output_path)


def load_traced(artifact: Path, *, device: str = "cpu") -> Callable[[torch.Tensor], torch.Tensor]:
    """Load a traced ``.pt`` on ``device``; returns ``input_ids -> logits``."""
    # open_artifact: the bytes load_exported verified, not whatever the path names by now
    with _quiet_jit(), open_artifact(artifact) as file:
        module = torch.jit.load(file, map_location=device).eval()

    def run(input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return module(input_ids.to(device))

    return run
