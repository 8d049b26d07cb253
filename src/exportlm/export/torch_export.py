"""The ``torch_export`` export target (``.pt2``) and its ``torch.export.load`` runtime.

A built-in target, registered in code
(:func:`~exportlm.export.builtins.register_builtin_targets`): the factory
:func:`export_torch_export` and the runtime :func:`load_torch_export`.

Batch and sequence are exported as ``Dim.DYNAMIC`` by default: torch.export
infers their ranges from the model (e.g. ``2 <= seq`` because size-1 dims are
specialized, or an upper bound from a position table) instead of failing on a
user-chosen bound. ``dynamic=False`` exports the traced shape only; the module
then refuses other shapes by design (a guard error).

``kv_cache=True`` exports the past-key-values graph instead (``docs/generation.md``):
``input_ids`` and the flat past of every layer in, logits and the flat present out,
with a past length that may be 0. Its runtime is a
:class:`~exportlm.export.generation.GenerationRuntime` (``prefill`` / ``decode``)
and still ``input_ids -> logits``.

transformers MoE families are exported with ``batched_mm`` experts: the default
``grouped_mm`` kernel is a ``transformers::`` custom op, so its ``.pt2`` cannot be
loaded in a process that has not imported transformers, and ``eager`` experts
fail on a data-dependent guard.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from exportlm.errors import InvalidModelError, InvalidOptionError
from exportlm.export._fake_cache import fake_tensor_cache_off
from exportlm.export._past import (
    PastKVWrapper,
    PastLayout,
    example_past,
    past_dynamic_shapes,
    probe_past_layout,
)
from exportlm.export._pt2_load import load_program
from exportlm.export._wrapper import ExportCacheWrapper
from exportlm.export.declaration import TargetInfo
from exportlm.export.generation import PastStepRuntime
from exportlm.export.guard import open_artifact
from exportlm.export.job import ExportRequest, export_job, job_target
from exportlm.export.runtime import TorchModuleRuntime, resolve_device

__all__ = [
    "TORCH_EXPORT_ATOL",
    "TORCH_EXPORT_RTOL",
    "TORCH_EXPORT_TARGET",
    "TorchExportGenerationRuntime",
    "build_torch_export_exporter",
    "export_torch_export",
    "load_torch_export",
]

# Tolerance: the exported graph runs the same ATen kernels as eager (measured max |diff| 0.0
# on the dense tiny models); MoE families run batched_mm experts instead of grouped_mm, a
# float-rounding difference (< 1e-6 measured). 1e-5 matches the torchscript target.
TORCH_EXPORT_ATOL = 1e-5
TORCH_EXPORT_RTOL = 1e-5


def _dynamic_shapes(dynamic: bool) -> dict[str, Any] | None:
    if not dynamic:
        return None
    dim = torch.export.Dim.DYNAMIC
    return {"input_ids": {0: dim, 1: dim}}


#: The ``torch_export`` target's declaration.
TORCH_EXPORT_TARGET = TargetInfo(
    name="torch_export",
    runtime="torch_export",
    atol=TORCH_EXPORT_ATOL,
    rtol=TORCH_EXPORT_RTOL,
    capabilities=frozenset({"dynamic_shapes", "cuda", "kv_cache"}),
    artifact="file",
    suffix=".pt2",
    executes_code=True,  # torch.export.load unpickles and runs code
    capture="torch.export",
    description="torch.export ExportedProgram .pt2 (dynamic batch/seq) run via torch.export.load",
    runtime_library="torch",
)


@job_target(TORCH_EXPORT_TARGET)
def export_torch_export(
    request: ExportRequest,
    *,
    example_inputs: Any = None,
    dynamic: bool = True,
    strict: bool = False,
    kv_cache: bool = False,
) -> Path:
    """Export ``model`` with ``torch.export`` and save the ``.pt2`` at ``output_path``.

    The factory is ``export_torch_export(model, output_path, **options)``; its body gets
    the :class:`~exportlm.export.job.ExportRequest` (:func:`~exportlm.export.job.job_target`).

    Args:
        model: any ``nn.Module`` whose ``forward(input_ids)`` returns logits,
            ``(logits, cache)`` or an object with ``.logits``; exported in eval mode
            with traceable MoE experts and restored afterwards.
        output_path: the ``.pt2`` file to write (atomically).
        example_inputs: ``input_ids`` [batch, seq] (or a tuple starting with them);
            default: deterministic ids [2, 8] from the vocabulary. Keep batch and
            sequence >= 2 for dynamic export (size-1 dims are specialized).
        dynamic: dynamic batch and sequence (``Dim.DYNAMIC``); ``False`` fixes the
            traced shape.
        strict: ``torch.export``'s strict (TorchDynamo) tracing; non-strict by default,
            as transformers models require.
        kv_cache: export the past-key-values graph (``input_ids`` + past -> logits +
            present) that generates with a KV cache; needs ``dynamic=True``.

    Raises:
        InvalidModelError / InvalidInputError: the model or inputs do not fit; with
            ``kv_cache=True``, a model without a usable KV cache (the message says why).
        ExportFailedError: ``torch.export`` or saving failed (the cause is chained).
    """
    if kv_cache and not dynamic:
        raise InvalidOptionError(
            "torch_export: kv_cache=True needs dynamic=True (the past length changes at every "
            "decode step); drop dynamic=False"
        )
    hint = "Try dynamic=False, or the 'torchscript' target."
    options = {"dynamic": dynamic, "strict": strict, "kv_cache": kv_cache}
    # fake_tensor_cache_off: torch.export traces faster without it, the same graph (_fake_cache.py).
    with (
        export_job(request, example_inputs, hint=hint, options=options) as job,
        fake_tensor_cache_off(),
    ):
        if kv_cache:
            layout = probe_past_layout(job.model)
            ids = job.inputs[0]
            past = example_past(layout, ids)
            program = torch.export.export(
                PastKVWrapper(job.model, layout).eval(),
                (ids, past),
                dynamic_shapes=past_dynamic_shapes(layout.num_layers),
                strict=strict,
            )
        else:
            wrapper = ExportCacheWrapper(job.model).eval()
            program = torch.export.export(
                wrapper, job.inputs[:1], dynamic_shapes=_dynamic_shapes(dynamic), strict=strict
            )
        with open(job.staged, "wb") as file:  # a file object: no suffix check on the name
            torch.export.save(program, file)
    return request.output_path


def build_torch_export_exporter() -> Any:
    """The declared ``torch_export`` export factory, for code that builds its own registry."""
    return export_torch_export


class TorchExportGenerationRuntime(PastStepRuntime):
    """A ``.pt2`` exported with ``kv_cache=True``: ``input_ids -> logits``, ``prefill``, ``decode``.

    Attributes:
        module: the loaded ``torch.export`` module.
        device: where inputs (and the past) are moved before a step.
    """

    def __init__(self, module: Any, device: torch.device, layout: PastLayout) -> None:
        super().__init__(layout, "torch_export")
        self.module = module
        self.device = device

    def _step(
        self, input_ids: torch.Tensor, past: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with torch.no_grad():
            out = self.module(input_ids.to(self.device), tuple(t.to(self.device) for t in past))
        return out[0].detach(), [t.detach() for t in out[1:]]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layers={self.layout.num_layers}, device={self.device})"


def _graph_past_layout(program: torch.export.ExportedProgram, path: Path) -> PastLayout | None:
    """The past layout of a past-key-values program (``None`` for a logits-only one)."""
    names = program.graph_signature.user_inputs
    if len(names) == 1:
        return None
    nodes = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    values = [nodes[name].meta.get("val") for name in names[1:]]
    if len(values) % 2 or not all(isinstance(v, torch.Tensor) and v.dim() == 4 for v in values):
        raise InvalidModelError(
            f"torch_export runtime: {path} takes {len(names)} inputs that are not input_ids and "
            "(key, value) past tensors per layer; export it with exportlm (kv_cache=True or not)"
        )
    heads = tuple((int(v.shape[1]), int(v.shape[3])) for v in values[::2])
    return PastLayout(heads, values[0].dtype, "tuple", "past_key_values")


def load_torch_export(
    artifact: Path, *, device: str = "cpu"
) -> TorchModuleRuntime | TorchExportGenerationRuntime:
    """Load a ``.pt2`` with ``torch.export.load(...).module()`` on ``device``.

    A past-key-values program (``kv_cache=True``) loads as a
    :class:`TorchExportGenerationRuntime`, any other as ``input_ids -> logits``.
    """
    path = Path(artifact)
    if not path.is_file():
        raise FileNotFoundError(f"torch_export runtime: no .pt2 file at {path}")
    target = resolve_device(device, "torch_export")
    # The verified bytes when load_exported checked them; a file object: any name loads.
    with open_artifact(path, what="torch_export artifact") as file:
        program = load_program(file)  # torch.export.load, faster: see _pt2_load.py
    layout = _graph_past_layout(program, path)
    module = program.module()
    if target.type != "cpu":
        module = module.to(target)
    if layout is not None:
        return TorchExportGenerationRuntime(module, target, layout)
    return TorchModuleRuntime(module, target, "torch_export")
