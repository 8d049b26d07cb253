"""The check catalogue: every built-in check, in documentation order, as plain data.

This module is the one place where a check's facts are declared (id, scope,
``per_model``, needs, markers, whether it is a value check, its cost), and (from
:mod:`.versions`) the catalogue version that added it. It imports neither torch nor Hypothesis (nor
anything else of the package but that data), so the planner can read it
without loading an implementation: each entry names its implementation as a
``"module:function"`` reference, imported the first time :attr:`CheckSpec.fn` is
read.

The order of :data:`BUILTIN_CHECKS` is the order of ``docs/checks.md`` (target
checks, then module-exporter checks) and the row order of the conformance
matrix. An implementation module marks each function with
``@check("<id>")`` (:func:`pytest_exportcheck.checks.check`), which only checks
that this catalogue points at it: the metadata is never repeated there.

Checks that are not built in (a test suite's, a plugin's) are appended to the live
mapping :data:`pytest_exportcheck.checks.CHECKS` with ``register_check`` or ``@check``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

from pytest_exportcheck.checks._spec_fields import (
    CatalogueError,
    check_fields,
    names,
    resolve,
    split_reference,
)
from pytest_exportcheck.checks.versions import CATALOGUE_VERSION, CHECKS_SINCE

if TYPE_CHECKING:
    from pytest_exportcheck.checks._api import CheckResult

__all__ = [
    "BUILTIN_CHECKS",
    "CATALOGUE_VERSION",
    "SCOPES",
    "CatalogueError",
    "CheckFn",
    "CheckSpec",
    "Scope",
]

Scope = Literal["target", "exporter"]
#: Every valid :data:`Scope`.
SCOPES: tuple[str, ...] = get_args(Scope)
#: A check implementation: ``(TargetCase | ExporterCase) -> CheckResult``.
CheckFn = Callable[[Any], "CheckResult"]


@dataclass(frozen=True)
class CheckSpec:
    """A check: its stable id, where it runs, what it needs, and its implementation.

    Attributes:
        id: stable id, used in item ids (``roundtrip_logits[onnx-llama-cpu]``),
            ``--export-checks`` and expected-failure declarations.
        scope: ``"target"`` (called with a ``TargetCase`` per export target and
            variant) or ``"exporter"`` (an ``ExporterCase`` per module exporter).
        impl: the implementation: a ``"package.module:function"`` reference,
            imported on first use of :attr:`fn`, or the function itself.
        per_model: target checks only: also parametrized over the toy model families.
        needs: target capabilities the check needs. A target that does not declare
            one gets no item of the check: the cell is *not applicable* (``·`` in the
            matrix, listed with the reason in the report's ``not_applicable``). A
            missing ``cuda`` (declared where the runtime's GPU build is installed) is
            a counted skip instead.
        artifacts: the artifact kinds (``"file"``, ``"directory"``) the check reads;
            empty: any. A target writing another kind is not applicable.
        devices: exporter checks only: the devices (``"cpu"``, ``"cuda"``) the check can
            run on; empty: any. A run on none of them has no item of it (not applicable).
        models: per-model target checks only: the toy families the check runs on;
            empty: every family. Other families get no item (not applicable).
        markers: pytest markers the plugin puts on the check's items
            (``"hypothesis"`` for checks driven by Hypothesis).
        per_device: exporter checks only: also run on each device of
            ``--export-device`` (the ``cuda`` item's id ends in ``-cuda``; the
            ``cpu`` item keeps the id ``check[exporter]``). Target checks always
            run per device.
        per_engine: per-model target checks only: one item per serving engine that
            takes what the target writes (``served[hf_checkpoint-vllm-llama-cpu]``);
            a target no engine takes gets no item of the check.
        summary: one line: what the check verifies (the first paragraph of the
            implementation's docstring, which holds the full description).
        since: the catalogue version that added a built-in check; ``None`` for a
            check outside the catalogue (registered by a test suite or a plugin),
            planned under any pinned version.
        value: a *value check*: it compares what an export produced (logits through
            the runtime, written tensors and configs, goldens). A row whose value
            checks all skipped is *unchecked*, not passed (``--export-strict``); a
            plugin's own check declares ``value=True`` to count the same way.
        cost: the relative cost of one item (Hypothesis-driven, decoding, several
            exports: more than 1), which balances the ``--export-shard`` split.
    """

    id: str
    scope: Scope
    impl: str | CheckFn
    per_model: bool = False
    needs: frozenset[str] = frozenset()
    markers: frozenset[str] = frozenset()
    summary: str = ""
    per_device: bool = False
    since: int | None = None
    per_engine: bool = False
    artifacts: frozenset[str] = frozenset()
    devices: frozenset[str] = frozenset()
    models: frozenset[str] = frozenset()
    value: bool = False
    cost: int = 1

    def __post_init__(self) -> None:
        # Accept any iterable of names (a tuple in a declaration), store a frozenset.
        for what in ("needs", "markers", "artifacts", "devices", "models"):
            object.__setattr__(self, what, names(self.id, what, getattr(self, what)))
        check_fields(self, SCOPES)
        if isinstance(self.impl, str):
            split_reference(self.id, self.impl)
        elif not callable(self.impl):
            raise CatalogueError(
                f"check {self.id!r}: impl {self.impl!r} is neither a 'module:function' "
                "reference nor a callable"
            )

    @property
    def fn(self) -> CheckFn:
        """The implementation (importing its module the first time it is read)."""
        if isinstance(self.impl, str):
            return cast(CheckFn, resolve(self.id, self.impl))
        return self.impl

    @property
    def doc(self) -> str:
        """The implementation's docstring: the full description of the check."""
        return (self.fn.__doc__ or "").strip()


_T = "pytest_exportcheck.checks.targets"
_E = "pytest_exportcheck.checks.exporters"
_G = "pytest_exportcheck.checks.generated"
_HYPOTHESIS = frozenset({"hypothesis"})
#: The families ``served`` runs (each engine run starts an engine process): dense, MoE.
SERVED_FAMILIES = frozenset({"llama", "qwen3_moe"})

#: Every built-in check, in documentation order (``docs/checks.md``).
_DECLARED: tuple[CheckSpec, ...] = (
    # ------------------------------------------------------------------ target checks
    CheckSpec(
        "plugin_loads",
        "target",
        f"{_T}.registration:plugin_loads",
        summary="The target's entry point (and its runtime's) loaded, and claims no taken name.",
    ),
    CheckSpec(
        "registered",
        "target",
        f"{_T}.registration:registered",
        summary="The name resolves; factory and runtime are callable with the contract's "
        "signatures.",
    ),
    CheckSpec(
        "artifact_contract",
        "target",
        f"{_T}.artifact:artifact_contract",
        summary="The export returns an existing path of the declared kind, and writes "
        "nothing else.",
    ),
    CheckSpec(
        "roundtrip_logits",
        "target",
        f"{_T}.roundtrip:roundtrip_logits",
        per_model=True,
        summary="The artifact, run in the target's own runtime, gives the eager model's logits.",
        value=True,
    ),
    CheckSpec(
        "dynamic_shapes",
        "target",
        f"{_T}.roundtrip:dynamic_shapes",
        per_model=True,
        needs=frozenset({"dynamic_shapes"}),
        summary="The same artifact runs at other batch sizes and sequence lengths than it "
        "was traced with.",
        value=True,
    ),
    CheckSpec(
        "cache_wrapper",
        "target",
        f"{_T}.roundtrip:cache_wrapper",
        summary="A model returning ``(logits, kv_cache)`` exports as logits only.",
        value=True,
    ),
    CheckSpec(
        "deterministic",
        "target",
        f"{_T}.roundtrip:deterministic",
        summary="Two exports of the same model give bit-identical runtime outputs.",
        value=True,
        cost=2,
    ),
    CheckSpec(
        "generation_parity",
        "target",
        f"{_T}.generation:generation_parity",
        per_model=True,
        needs=frozenset({"kv_cache"}),
        summary="Greedy decoding through the artifact's KV cache gives the eager model's "
        "tokens and logits.",
        value=True,
        cost=3,
    ),
    CheckSpec(
        "atomic_failure",
        "target",
        f"{_T}.failures:atomic_failure",
        summary="A failing export leaves no artifact, and an existing artifact untouched.",
    ),
    CheckSpec(
        "unknown_kwargs",
        "target",
        f"{_T}.failures:unknown_kwargs",
        summary="A misspelled option is refused with a ``TypeError`` naming it, never swallowed.",
    ),
    CheckSpec(
        "trust",
        "target",
        f"{_T}.trust:trust",
        summary="A target whose artifacts can execute code when loaded declares "
        "``executes_code=True``.",
    ),
    CheckSpec(
        "roundtrip_generated",
        "target",
        f"{_G}.roundtrip:roundtrip_generated",
        markers=_HYPOTHESIS,
        summary="Generated structures roundtrip through the target within its declared tolerance.",
        value=True,
        cost=10,
    ),
    CheckSpec(
        "checkpoint_names",
        "target",
        f"{_T}.checkpoint:checkpoint_names",
        per_model=True,
        needs=frozenset({"quantized"}),
        artifacts=frozenset({"directory"}),
        summary="Names in a quantized checkpoint's configs are the names its tensors are "
        "saved under.",
        value=True,
    ),
    CheckSpec(
        "loadable",
        "target",
        f"{_T}.loadable:loadable",
        per_model=True,
        needs=frozenset({"quantized"}),
        artifacts=frozenset({"directory"}),
        summary="Quantized checkpoints (FP8 + FP8 KV, NVFP4, INT4 AWQ, INT8) pass every "
        "error-level rule of ``exportlm inspect``.",
        value=True,
        cost=3,
    ),
    CheckSpec(
        "roundtrip_quantized",
        "target",
        f"{_T}.quantized:roundtrip_quantized",
        needs=frozenset({"quantized"}),
        summary="A quantized model's artifact, in the target's runtime, gives the fake-quant "
        "model's logits.",
        value=True,
        cost=4,
    ),
    CheckSpec(
        "served",
        "target",
        f"{_T}.served:served",
        per_model=True,
        per_engine=True,
        models=SERVED_FAMILIES,
        summary="The artifact, loaded by the real serving engines that take it, gives the eager "
        "tokens.",
        value=True,
    ),
    # ------------------------------------------------------------------ module-exporter checks
    CheckSpec(
        "mro_match",
        "exporter",
        f"{_E}.dispatch:mro_match",
        summary="Generated subclasses of every module type the exporter claims are still "
        "claimed by it.",
    ),
    CheckSpec(
        "name_match",
        "exporter",
        f"{_E}.dispatch:name_match",
        summary="Class names are matched exactly: a name merely containing a key is not claimed.",
    ),
    CheckSpec(
        "predicate_match",
        "exporter",
        f"{_E}.dispatch:predicate_match",
        summary="An entry with a predicate claims a module only when keys and predicate "
        "both match.",
    ),
    CheckSpec(
        "precedence",
        "exporter",
        f"{_E}.order:precedence",
        summary="Order is stable; re-registration replaces in place; ``prepend`` goes first.",
    ),
    CheckSpec(
        "reachable",
        "exporter",
        f"{_E}.order:reachable",
        summary="The exporter is not fully shadowed by earlier entries for its own keys.",
    ),
    CheckSpec(
        "claims_all_quantized",
        "exporter",
        f"{_E}.contract:claims_all_quantized",
        summary="Every quantized module of every toy model is claimed by exactly one exporter.",
    ),
    CheckSpec(
        "export_contract",
        "exporter",
        f"{_E}.contract:export_contract",
        summary="Exports write only under the module's prefix, leave it unchanged, and emit "
        "sane tensors.",
        value=True,
    ),
    CheckSpec(
        "moe_inputs",
        "exporter",
        f"{_E}.layout:moe_inputs",
        summary="Experts of one block share ``input_scale``; gate and up of one expert share "
        "``weight_scale``.",
        value=True,
    ),
    CheckSpec(
        "tied_weights",
        "exporter",
        f"{_E}.layout:tied_weights",
        summary="Tied weights are written once, by name; no real weight is dropped; "
        "differing ties raise.",
        value=True,
    ),
    CheckSpec(
        "quantized_generated",
        "exporter",
        f"{_G}.quantized:quantized_generated",
        markers=_HYPOTHESIS,
        summary="Generated structures, quantized, are exported completely and exactly.",
        value=True,
        cost=10,
    ),
    CheckSpec(
        "golden_checkpoint",
        "exporter",
        f"{_E}.golden:golden_checkpoint",
        summary="What the exporter writes for every golden case equals its golden, byte for byte.",
        per_device=True,
        value=True,
        cost=3,
    ),
    CheckSpec(
        "golden_calibration",
        "exporter",
        f"{_E}.golden:golden_calibration",
        summary="The activation scales the exporter writes after real calibration match the "
        "golden's within ``rtol=1e-4, atol=1e-12`` "
        "(``|obtained - golden| <= atol + rtol * |golden|``).",
        per_device=True,
        value=True,
        cost=3,
    ),
    CheckSpec(
        "fp8_gemm",
        "exporter",
        "pytest_exportcheck.checks.exporters.fp8_gemm:fp8_gemm",
        markers=frozenset({"cuda"}),
        devices=frozenset({"cuda"}),
        summary="On a CUDA device of compute capability 8.9 or newer, the exported FP8 "
        "linears run through ``torch._scaled_mm`` match the fake-quant forward within "
        "``|gemm - fake_quant| <= 1e-3 * (|x_q| @ |w_q|^T) + 1e-6``.",
        per_device=True,
        value=True,
    ),
)

#: The built-in checks, each with the catalogue version that added it (``since``).
BUILTIN_CHECKS: tuple[CheckSpec, ...] = tuple(
    replace(spec, since=CHECKS_SINCE.get(spec.id, CATALOGUE_VERSION)) for spec in _DECLARED
)
