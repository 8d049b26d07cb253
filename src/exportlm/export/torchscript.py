"""The ``torchscript`` export target (``.pt``) and its ``torch.jit.load`` runtime.

A built-in target, registered in code
(:func:`~exportlm.export.builtins.register_builtin_targets`): the factory
:func:`export_torchscript` and the runtime :func:`load_torchscript`.

``method="trace"`` (default) records the ops of one forward through
:class:`~exportlm.export.ExportCacheWrapper`; batch and sequence stay symbolic
for models whose forward has no Python control flow on tensor values (every
built-in toy family). ``method="script"`` compiles the model's Python source;
none of the built-in toy families scripts: each family declares that failure
itself (``exportlm.models.model_expected_failures``); the target knows nothing of toy models.

torch 2.13 deprecates ``torch.jit``; every export raises two dozen deprecation
warnings inside torch. They become one :class:`TorchScriptDeprecationWarning`
per export.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from exportlm.errors import InvalidOptionError
from exportlm.export._moe import TRACEABLE_EXPERTS
from exportlm.export._quiet import CapturedNoise, warn_caller
from exportlm.export._wrapper import ExportCacheWrapper
from exportlm.export.declaration import TargetInfo
from exportlm.export.guard import open_artifact
from exportlm.export.job import ExportRequest, export_job, job_target
from exportlm.export.runtime import TorchModuleRuntime, resolve_device

__all__ = [
    "TORCHSCRIPT_ATOL",
    "TORCHSCRIPT_RTOL",
    "TORCHSCRIPT_TARGET",
    "TorchScriptDeprecationWarning",
    "build_torchscript_exporter",
    "export_torchscript",
    "load_torchscript",
]

# Tolerance: a traced graph runs the same ATen kernels as eager, so logits are bit-identical
# on the tiny models (measured max |diff| 0.0 for every built-in family); the MoE families
# are traced with batched_mm experts, whose sums differ from the default grouped_mm kernel by
# float rounding (< 1e-6 measured). 1e-5 leaves room for the profiling executor's fusions on
# larger models and CUDA without hiding a wrong graph.
TORCHSCRIPT_ATOL = 1e-5
TORCHSCRIPT_RTOL = 1e-5


class TorchScriptDeprecationWarning(FutureWarning):
    """``torch.jit`` is deprecated in torch >= 2.9; raised once per TorchScript export."""


def _warn_deprecated(noise: CapturedNoise, method: str) -> None:
    deprecations = [
        w
        for w in noise.of_category(Warning)
        if issubclass(w.category, (DeprecationWarning, FutureWarning))
        and "torch.jit" in str(w.message)
    ]
    if deprecations:
        warn_caller(
            TorchScriptDeprecationWarning(
                f"torch.jit.{method} is deprecated in torch {torch.__version__} "
                f"({len(deprecations)} deprecation warning(s) from torch.jit were folded into "
                "this one); the .pt still loads with torch.jit.load. Prefer the "
                "'torch_export' target (.pt2) for new deployments."
            )
        )


def _script(model: nn.Module) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        # An advisory about attributes annotated in __init__ (transformers' models and
        # ours do this); it is not a scripting failure and says nothing actionable.
        warnings.filterwarnings(
            "ignore", message="The TorchScript type system doesn't support instance-level"
        )
        return torch.jit.script(model)  # type: ignore[no-any-return]


def _trace(model: nn.Module, inputs: tuple[torch.Tensor, ...], check_trace: bool) -> Any:
    wrapper = ExportCacheWrapper(model).eval()
    with torch.no_grad():
        return torch.jit.trace(wrapper, inputs[:1], check_trace=check_trace)


#: The ``torchscript`` target's declaration.
TORCHSCRIPT_TARGET = TargetInfo(
    name="torchscript",
    runtime="torchscript",
    atol=TORCHSCRIPT_ATOL,
    rtol=TORCHSCRIPT_RTOL,
    capabilities=frozenset({"dynamic_shapes", "cuda"}),
    artifact="file",
    suffix=".pt",
    variants={"trace": {"method": "trace"}, "script": {"method": "script"}},
    capture={"trace": "torchscript-trace", "script": "torchscript-script"},
    executes_code=True,  # torch.jit.load unpickles and runs code
    # Declared here, not accepted by a project's CI configuration: every toy family fails
    # torch.jit.script (each family declares the cause), so no value check of the row can
    # pass on a fresh install; the row still runs, and is shown as declared unchecked.
    unchecked={
        "script": "no toy family scripts under TorchScript (a variable-length KV-cache "
        "tuple it cannot type; each family declares it); use method='trace'"
    },
    description="TorchScript .pt (torch.jit.trace, or script) run with torch.jit.load",
    runtime_library="torch",
)


@job_target(TORCHSCRIPT_TARGET)
def export_torchscript(
    request: ExportRequest,
    *,
    example_inputs: Any = None,
    method: Literal["trace", "script"] = "trace",
    check_trace: bool = False,
) -> Path:
    """Export ``model`` as a TorchScript ``.pt`` at ``output_path``; returns the path.

    The factory is ``export_torchscript(model, output_path, **options)``; its body gets
    the :class:`~exportlm.export.job.ExportRequest` (:func:`~exportlm.export.job.job_target`).

    Args:
        model: any ``nn.Module`` whose ``forward(input_ids)`` returns logits,
            ``(logits, cache)`` or an object with ``.logits``; exported in eval mode
            (with traceable MoE experts for tracing) and restored afterwards.
        output_path: the ``.pt`` file to write (atomically).
        example_inputs: ``input_ids`` [batch, seq] (or a tuple starting with them) to
            trace with; default: deterministic ids [2, 8] from the vocabulary.
        method: ``"trace"`` (through ``ExportCacheWrapper``) or ``"script"``
            (``torch.jit.script(model)``; the model must be scriptable and its
            ``forward(input_ids)`` must return logits or a tuple starting with them).
        check_trace: re-run and compare the trace (torch's ``check_trace``); off by
            default: it doubles the export time, and the conformance suite checks
            the artifact's logits instead.

    Raises:
        InvalidModelError / InvalidInputError: the model or inputs do not fit.
        ExportFailedError: tracing or scripting failed (the cause is chained).
    """
    if method not in ("trace", "script"):
        raise InvalidOptionError(f"method must be 'trace' or 'script', got {method!r}")
    hint = (
        "Scripting needs TorchScript-compatible model source; try method='trace'."
        if method == "script"
        else "Try the 'torch_export' target, which handles data-dependent shapes better."
    )
    experts = TRACEABLE_EXPERTS if method == "trace" else None
    with export_job(
        request,
        example_inputs,
        experts=experts,
        hint=hint,
        options={"method": method, "check_trace": check_trace},
    ) as job:
        module = (
            _script(job.model) if method == "script" else _trace(job.model, job.inputs, check_trace)
        )
        torch.jit.save(module, str(job.staged))
    _warn_deprecated(job.noise, method)
    return request.output_path


def build_torchscript_exporter() -> Any:
    """The declared ``torchscript`` export factory, for code that builds its own registry."""
    return export_torchscript


def load_torchscript(artifact: Path, *, device: str = "cpu") -> TorchModuleRuntime:
    """Load a ``.pt`` with ``torch.jit.load`` on ``device``; returns ``input_ids -> logits``."""
    path = Path(artifact)
    if not path.is_file():
        raise FileNotFoundError(f"torchscript runtime: no TorchScript file at {path}")
    target = resolve_device(device, "torchscript")
    # The verified bytes when load_exported checked them (torch.jit.load reads a file object
    # into memory first; a .pt is small next to the process that runs it).
    with open_artifact(path, what="torchscript artifact") as file:
        module = torch.jit.load(file, map_location=target).eval()
    return TorchModuleRuntime(module, target, "torchscript")
