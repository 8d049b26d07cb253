"""Checks on model structures drawn by Hypothesis instead of the fixed toy families.

The toy families all have vocabulary 256, hidden 128 and two layers, so a target
that pads the vocabulary wrongly or hard-codes a layer count passes every
per-model check. These checks draw decoder structures with
:func:`pytest_exportcheck.strategies.model_specs` (1-4 layers, GQA / MQA heads,
tied or untied ``lm_head``, dense Llama or Mixtral / Qwen3-MoE experts,
vocabularies 97-400 that are never multiples of 64), build them with
:func:`exportlm.models.build_from_spec` (seeded, nothing downloaded) and:

- ``roundtrip_generated`` (per target): export, load in the target's runtime,
  compare logits within the target's tolerance at the traced shape and at a
  drawn other shape;
- ``quantized_generated`` (per module exporter): quantize with every recipe that
  fits, export the quantized state through a recording registry, and check
  claims, FP8 weights, ties and dropped weights.

A failure shrinks (Hypothesis) to the smallest structure, which the message
prints as JSON together with a command reproducing it outside pytest. The
properties run with ``database=None``; under the ``exportcheck-ci`` profile
(``CI`` set) they are derandomized, so every CI run checks the same structures.
"""

from __future__ import annotations

import functools
import re
import secrets
import shlex
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hypothesis.core
import torch
from hypothesis import given, seed, settings
from hypothesis.errors import HypothesisException
from torch import nn

from exportlm.errors import UnsupportedFormatError
from exportlm.export import TargetInfo
from exportlm.models import ModelSpec, build_from_spec
from exportlm.quant import is_quantized_module, quantize
from exportlm.quant._formats import QuantFormat
from exportlm.quant._modules import QuantExperts, QuantLinear
from pytest_exportcheck.checks._api import CheckResult, ExporterCase, TargetCase, check
from pytest_exportcheck.checks._support import (
    TRACED_SHAPE,
    CheckAbort,
    aborts_to_result,
    accepts_reason,
    artifact_name,
    error_text,
    export_instance,
    load_runtime,
    require_device,
    target_info,
)
from pytest_exportcheck.checks._survey import (
    SURVEY_RECIPES,
    QuantizedModel,
    _registry_state,
    _survey_one,
    exporter_entry,
    exporter_names,
)
from pytest_exportcheck.checks.exporters import _listed, _tie_groups
from pytest_exportcheck.checks.targets import _roundtrip
from pytest_exportcheck.strategies import input_shapes, model_settings, model_specs

__all__ = [
    "GENERATED_EXAMPLES",
    "GENERATED_RECIPES",
    "GeneratedFailure",
    "generated_budget",
    "quantized_generated",
    "repro_command",
    "roundtrip_generated",
]

#: Structures drawn per check run (the profile decides whether they are derandomized).
GENERATED_EXAMPLES = 3
#: Recipes ``quantized_generated`` tries on each structure (those that do not fit are skipped).
GENERATED_RECIPES = SURVEY_RECIPES


class GeneratedFailure(AssertionError):
    """A property failed on one drawn structure; carries the structure for the report."""

    def __init__(
        self,
        spec: ModelSpec,
        message: str,
        shape: tuple[int, int] | None = None,
        **details: Any,
    ) -> None:
        super().__init__(message)
        self.spec = spec
        self.message = message
        self.shape = shape
        self.details = details


@dataclass
class _Tally:
    """What the drawn examples did (for the result message and the report)."""

    accepted: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    shapes: list[list[int]] = field(default_factory=list)
    families: Counter[str] = field(default_factory=Counter)
    vocab_sizes: list[int] = field(default_factory=list)
    claimed: int = 0
    fp8_weights: int = 0
    quantized_models: int = 0
    not_fitting: Counter[str] = field(default_factory=Counter)


def generated_budget() -> int:
    """Structures a check draws: :data:`GENERATED_EXAMPLES` under exportcheck's own (or
    Hypothesis' ``default`` / ``ci``) profile; under a profile the user chose
    (``--hypothesis-profile``), that profile's ``max_examples``."""
    from hypothesis import settings

    from pytest_exportcheck import HYPOTHESIS_PROFILE

    name = settings.get_current_profile_name()
    if name in ("default", "ci") or name in HYPOTHESIS_PROFILE.values():
        return GENERATED_EXAMPLES
    return int(settings().max_examples)


#: Seed of ``quantized_generated`` in a randomized run: one per process, so every
#: exporter row draws the same structures and shares their (cached) recorded exports.
_PROCESS_SEED = secrets.randbits(64)


def _shared_seed(prop: Callable[[], None]) -> Callable[[], None]:
    """``prop`` seeded with :data:`_PROCESS_SEED`, unless derandomized or ``--hypothesis-seed``."""
    if settings().derandomize or getattr(hypothesis.core, "global_force_seed", None) is not None:
        return prop
    seeded: Callable[[], None] = seed(_PROCESS_SEED)(prop)
    return seeded


def _run(prop: Callable[[], None]) -> GeneratedFailure | None:
    """Run a Hypothesis property; the (shrunk) failure, or ``None`` when it holds."""
    try:
        prop()
    except GeneratedFailure as failure:
        return failure
    return None


def _safe(text: str) -> str:
    return re.sub(r"[^\w.-]", "_", text)


def repro_command(
    target: str,
    spec_file: Path,
    out: Path,
    *,
    seed: int = 0,
    options: dict[str, Any] | None = None,
) -> str:
    """``exportlm export --target T --model FILE.json --out OUT --verify`` (with ``-o`` / ``--seed``)."""
    parts = ["exportlm", "export", "--target", target, "--model", str(spec_file)]
    parts += ["--out", str(out)]
    if seed:
        parts += ["--seed", str(seed)]
    for key, value in sorted((options or {}).items()):
        parts += ["-o", f"{key}={value!r}"]
    parts.append("--verify")
    return shlex.join(parts)


def _write_spec(case_workdir: Path, stem: str, spec: ModelSpec) -> Path:
    path = case_workdir / f"{_safe(stem)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(spec.to_json(), encoding="utf-8")
    return path


def _failure_result(
    failure: GeneratedFailure,
    headline: str,
    spec_file: Path,
    command: str | None,
    note: str = "",
) -> CheckResult:
    lines = [
        headline,
        failure.message,
        f"smallest failing structure (Hypothesis shrank it), written to {spec_file}:",
        failure.spec.to_json().rstrip(),
    ]
    if command is not None:
        lines += ["reproduce outside pytest:", f"  {command}"]
    if note:
        lines.append(note)
    return CheckResult.failed(
        "\n".join(lines),
        spec=failure.spec.to_dict(),
        spec_file=str(spec_file),
        repro=command,
        shape=None if failure.shape is None else list(failure.shape),
        **failure.details,
    )


# ----------------------------------------------------------------------------- roundtrip_generated


def _build(spec: ModelSpec, seed: int, device: str) -> nn.Module:
    model: nn.Module = build_from_spec(spec, seed=seed)
    return model.to(device)


def _again(failure: GeneratedFailure) -> GeneratedFailure:
    """A fresh exception with the same content (a memoized outcome raised once more)."""
    return GeneratedFailure(failure.spec, failure.message, failure.shape, **failure.details)


@dataclass
class _Memo:
    """Outcomes by structure within one check run.

    The shrinker replays many choice sequences that draw an equal structure (and
    shape); each outcome is a pure function of them, so a replay costs nothing
    instead of a model build and an export. A few loaded runtimes are kept for
    the other shapes of a structure.
    """

    traced: dict[ModelSpec, GeneratedFailure | str | None] = field(default_factory=dict)
    shapes: dict[tuple[ModelSpec, tuple[int, int]], GeneratedFailure | None] = field(
        default_factory=dict
    )
    loaded: dict[ModelSpec, tuple[nn.Module, Callable[[torch.Tensor], Any]]] = field(
        default_factory=dict
    )
    kept: int = 4

    def keep(self, spec: ModelSpec, model: nn.Module, runtime: Callable[..., Any]) -> None:
        self.loaded[spec] = (model, runtime)
        while len(self.loaded) > self.kept:
            del self.loaded[next(iter(self.loaded))]


def _compare(
    case: TargetCase,
    info: TargetInfo,
    spec: ModelSpec,
    model: nn.Module,
    runtime: Callable[[torch.Tensor], Any],
    shape: tuple[int, int],
) -> GeneratedFailure | None:
    try:
        result = _roundtrip(case, info, model, runtime, shape)
    except CheckAbort as abort:
        return GeneratedFailure(spec, abort.result.message, shape)
    if not result.ok:
        return GeneratedFailure(spec, result.message, shape, **dict(result.details))
    return None


def _export_traced(
    case: TargetCase, info: TargetInfo, spec: ModelSpec, memo: _Memo, counter: Iterator[int]
) -> GeneratedFailure | str | None:
    """Build, export, load and compare at the traced shape: a failure, a refusal or ``None``."""
    try:
        model = _build(spec, case.seed, case.device)
    except Exception as err:  # a structure the builder cannot take is a bug of the strategy
        return GeneratedFailure(spec, f"building the model raised {error_text(err)}")
    reason = accepts_reason(case.target, model)
    if reason:
        return reason
    try:
        artifact = export_instance(case, model, case.workdir / f"generated-{next(counter)}")
        runtime = load_runtime(case, artifact)
    except CheckAbort as abort:
        return GeneratedFailure(spec, abort.result.message)
    except HypothesisException:
        raise
    except Exception as err:
        return GeneratedFailure(spec, f"the export raised {error_text(err)}")
    memo.keep(spec, model, runtime)
    return _compare(case, info, spec, model, runtime, TRACED_SHAPE)


def _roundtrip_one(
    case: TargetCase,
    info: TargetInfo,
    spec: ModelSpec,
    shape: tuple[int, int],
    tally: _Tally,
    memo: _Memo,
    counter: Iterator[int],
) -> None:
    """Export one structure and compare its logits; raises :class:`GeneratedFailure`."""
    if spec not in memo.traced:
        outcome = _export_traced(case, info, spec, memo, counter)
        memo.traced[spec] = outcome
        if isinstance(outcome, str):
            tally.refused[outcome] += 1
        else:
            tally.accepted += 1
            tally.families[spec.family] += 1
            tally.vocab_sizes.append(spec.vocab_size)
    outcome = memo.traced[spec]
    if isinstance(outcome, GeneratedFailure):
        raise _again(outcome)
    if isinstance(outcome, str) or not info.has("dynamic_shapes"):
        return
    key = (spec, shape)
    if key not in memo.shapes:
        if spec not in memo.loaded:  # evicted: the artifact cache serves the export again
            memo.traced.pop(spec)
            _roundtrip_one(case, info, spec, shape, tally, memo, counter)
            return
        model, runtime = memo.loaded[spec]
        memo.shapes[key] = _compare(case, info, spec, model, runtime, shape)
        tally.shapes.append(list(shape))
    failure = memo.shapes[key]
    if failure is not None:
        raise _again(failure)


def _phases(case: TargetCase) -> dict[str, Any]:
    """No shrinking for an item declared as an expected failure: its first failure is enough."""
    if not case.options.get("expected_failure"):
        return {}
    from hypothesis import Phase

    return {"phases": [Phase.explicit, Phase.reuse, Phase.generate]}


@check("roundtrip_generated", scope="target")
@aborts_to_result
def roundtrip_generated(case: TargetCase) -> CheckResult:
    """Generated structures roundtrip through the target within its declared tolerance.

    Hypothesis draws :data:`GENERATED_EXAMPLES` decoder structures (or the
    ``max_examples`` of a profile chosen with ``--hypothesis-profile``)
    (:func:`~pytest_exportcheck.strategies.model_specs`: 1-4 layers, hidden
    16-64, GQA / MQA heads, tied or untied ``lm_head``, dense Llama or Mixtral /
    Qwen3-MoE, vocabulary 97-400 never a multiple of 64) and, for targets
    declaring ``dynamic_shapes``, an input shape other than the traced ``[2, 8]``
    (:func:`~pytest_exportcheck.strategies.input_shapes`: batch 1-4, sequence
    1-16). Each structure is built with ``build_from_spec`` (seed ``case.seed``);
    structures the target's ``accepts`` refuses are counted and skipped (a
    counted skip when it refuses all). The rest are exported (cached by model
    through ``case.export_instance``), loaded in the target's runtime and
    compared with the eager model as ``roundtrip_logits`` does: every element
    within ``atol + rtol * |expected|`` of the target's declared ``atol`` /
    ``rtol`` (no exact float comparison), no NaN / inf, at ``[2, 8]`` and at the
    drawn shape. An export or runtime error fails too. A failure shrinks to the
    smallest structure, which the message prints as JSON (also written to a
    file) with the ``exportlm export --model FILE.json ... --verify`` command
    that reproduces it. An item declared as an expected failure is not shrunk:
    its first failing structure is reported.
    """
    info = target_info(case)
    require_device(case, info)
    tally = _Tally()
    budget = generated_budget()
    counter = iter(range(1_000_000))
    memo = _Memo()
    start = time.perf_counter()

    @model_settings(max_examples=budget, database=None, **_phases(case))
    @given(spec=model_specs(), shape=input_shapes())
    def prop(spec: ModelSpec, shape: tuple[int, int]) -> None:
        _roundtrip_one(case, info, spec, shape, tally, memo, counter)

    failure = _run(prop)
    seconds = round(time.perf_counter() - start, 2)
    if failure is not None:
        spec_file = _write_spec(case.workdir, f"roundtrip_generated-{case.target_id}", failure.spec)
        out = case.workdir / "repro" / artifact_name(info)
        command = repro_command(
            case.target, spec_file, out, seed=case.seed, options=dict(case.export_kwargs)
        )
        note = ""
        if failure.shape is not None and failure.shape != TRACED_SHAPE:
            note = (
                f"(the mismatch is at input_ids {list(failure.shape)}; --verify runs the "
                f"traced shape {list(TRACED_SHAPE)})"
            )
        return _failure_result(
            failure,
            f"{case.target_id} fails on a generated model structure "
            f"(tolerance atol={info.atol:g} rtol={info.rtol:g}):",
            spec_file,
            command,
            note,
        )
    refused = dict(tally.refused)
    if tally.accepted == 0:
        return CheckResult.skipped(
            f"target {case.target_id!r} refused every generated structure: "
            + "; ".join(f"{reason} ({n}x)" for reason, n in refused.items()),
            refused=sum(refused.values()),
        )
    return CheckResult.passed(
        f"{tally.accepted} generated structure(s) within atol={info.atol:g} rtol={info.rtol:g} "
        f"(families {dict(tally.families)}, vocab {tally.vocab_sizes}, "
        f"other shapes {tally.shapes or 'not checked (no dynamic_shapes)'}); "
        f"{sum(refused.values())} refused by accepts; {seconds} s",
        accepted=tally.accepted,
        refused=sum(refused.values()),
        seconds=seconds,
    )


# ----------------------------------------------------------------------------- quantized_generated


def _quantize_spec(spec: ModelSpec, recipe: str, seed: int) -> nn.Module | str:
    try:
        return quantize(build_from_spec(spec, seed=seed), recipe)
    except UnsupportedFormatError as err:
        return f"{recipe} does not fit: {err}"


@functools.lru_cache(maxsize=64)
def _generated_survey(
    spec: ModelSpec, recipe: str, seed: int, state: tuple[Any, ...]
) -> QuantizedModel | str:
    """The recorded export of ``spec`` quantized with ``recipe`` (or why it does not fit).

    Cached per registry state, so the exporter rows of one run share it (under
    the derandomized CI profile they draw the same structures).
    """
    model = _quantize_spec(spec, recipe, seed)
    if isinstance(model, str):
        return model
    return _survey_one(f"generated:{spec.family}", recipe, model, exporter_names())


def _expected_fp8(q: QuantizedModel) -> dict[str, tuple[str, torch.Tensor]]:
    """Exported weight prefix -> (module name, fake-quantized weight) of every FP8 weight.

    ``QuantLinear``: ``{name}`` -> ``weight_quantizer.fake_quant(effective_weight())``;
    stacked experts: ``{name}.{e}.{gate,up,down}_proj`` -> expert ``e``'s rows of the
    projection's fake-quantized weight (gate/up split as the experts store them).
    """
    expected: dict[str, tuple[str, torch.Tensor]] = {}
    with torch.no_grad():
        for claim in q.claims:
            module = claim.module
            if isinstance(module, QuantLinear):
                quantizer = module.weight_quantizer
                if quantizer.enabled and quantizer.format is QuantFormat.FP8:
                    fq = quantizer.fake_quant(module.effective_weight())
                    expected[claim.name] = (claim.name, fq)
            elif isinstance(module, QuantExperts):
                for projection in module.PROJECTIONS:
                    quantizer = module.weight_quantizer_of(projection)
                    if not (quantizer.enabled and quantizer.format is QuantFormat.FP8):
                        continue
                    fq = quantizer.fake_quant(module.effective_weight(projection))
                    for e in range(fq.shape[0]):
                        if projection == "down_proj":
                            parts = {"down_proj": fq[e]}
                        else:
                            gate, up = module.split_gate_up(fq[e], dim=-2)
                            parts = {"gate_proj": gate, "up_proj": up}
                        for linear, weight in parts.items():
                            expected[f"{claim.name}.{e}.{linear}"] = (claim.name, weight)
    return expected


#: ``(exporter responsible, or None for the registry / driver; what is wrong)``.
_Problem = tuple[str | None, str]


def _fp8_problems(
    q: QuantizedModel, owner_of: dict[str, str], tally: _Tally, exporter: str
) -> list[_Problem]:
    """Exported FP8 weights whose dequantization differs from the fake-quant weight (exact)."""
    problems: list[_Problem] = []
    for prefix, (module_name, fake) in _expected_fp8(q).items():
        data = q.tensors.get(f"{prefix}.weight")
        scale = q.tensors.get(f"{prefix}.weight_scale")
        who = owner_of.get(module_name)
        if data is None or scale is None:
            continue  # reported as a dropped weight
        if data.dtype != torch.float8_e4m3fn or scale.numel() != 1:
            problems.append(
                (
                    who,
                    f"{prefix}.weight is {data.dtype} with a weight_scale of shape "
                    f"{list(scale.shape)}; the FP8 recipe exports float8_e4m3fn with one scale",
                )
            )
            continue
        tally.fp8_weights += who == exporter
        # Elementwise on identical inputs (the same FP8 codes, the same float32 scale):
        # a loader's dequantization and fake_quant are the same pure function, so exact.
        dequantized = (data.to(torch.float32) * scale.to(torch.float32).reshape(())).to(fake.dtype)
        if dequantized.shape != fake.shape:
            problems.append(
                (
                    who,
                    f"{prefix}.weight has shape {list(data.shape)}, the fake-quantized "
                    f"weight {list(fake.shape)}",
                )
            )
        elif not torch.equal(dequantized, fake):
            diff = (dequantized - fake).abs()
            problems.append(
                (
                    who,
                    f"{prefix}.weight * weight_scale differs from the fake-quantized weight in "
                    f"{int((diff != 0).sum())} of {fake.numel()} elements (max abs "
                    f"{float(diff.max()):.3g}); they must be bit-identical",
                )
            )
    return problems


def _expected_names(owner: str, leaf: str, module: nn.Module) -> list[str] | None:
    """The tensor names a built-in quantized module's parameter is exported under (None: unknown)."""
    if isinstance(module, QuantLinear):
        return [f"{owner}.{leaf}"]
    if isinstance(module, QuantExperts):
        projection = leaf.removesuffix("_bias")
        kind = "bias" if leaf.endswith("_bias") else "weight"
        if projection not in module.PROJECTIONS:
            return None
        linears = ("down_proj",) if projection == "down_proj" else ("gate_proj", "up_proj")
        experts = int(getattr(module, projection).shape[0])
        return [f"{owner}.{e}.{linear}.{kind}" for e in range(experts) for linear in linears]
    return None


def _dropped_problems(q: QuantizedModel, owner_of: dict[str, str]) -> list[_Problem]:
    """Parameters (ties aside) that reach the checkpoint under no name."""
    problems: list[_Problem] = []
    tied = {name for group in _tie_groups(q.model) for name in group}
    modules = dict(q.model.named_modules())
    for name, _ in q.model.named_parameters():
        if name in tied or name in q.tensors:
            continue
        owner, _, leaf = name.rpartition(".")
        who = owner_of.get(owner)
        if who is None:
            problems.append((None, f"weight {name} was dropped (no exporter claims {owner!r})"))
            continue
        expected = _expected_names(owner, leaf, modules[owner])
        if expected is None:  # a module type the check does not know: anything under it
            if not any(n.startswith(f"{owner}.") for n in q.tensors):
                problems.append((who, f"weight {name} was dropped: nothing written under {owner}"))
            continue
        missing = [n for n in expected if n not in q.tensors]
        if missing:
            problems.append(
                (who, f"weight {name} was dropped: {_listed(missing)} not written by {who}")
            )
    return problems


def _quantized_problems(q: QuantizedModel, tally: _Tally, exporter: str) -> list[_Problem]:
    """Every problem of one recorded export (see :func:`quantized_generated`)."""
    owner_of = {c.name: c.exporter for c in q.claims if c.exporter is not None}
    if q.error is not None:
        failing = [c.exporter for c in q.calls if c.error is not None]
        return [(failing[0] if failing else None, f"the export raised {q.error.splitlines()[0]}")]
    problems: list[_Problem] = []
    calls: defaultdict[str, list[str]] = defaultdict(list)
    for call in q.calls:
        calls[call.module_name].append(call.exporter)
    for name, module in q.model.named_modules():
        if not is_quantized_module(module):
            continue
        by = calls.get(name, [])
        if not by:
            problems.append(
                (None, f"quantized module {name} ({type(module).__name__}) is not exported")
            )
        elif len(by) > 1:
            problems.append(
                (by[0], f"quantized module {name} is exported {len(by)} times (by {by})")
            )
    for group in _tie_groups(q.model):
        written = [n for n in group if n in q.tensors]
        if len(written) != 1:
            problems.append((None, f"tied {group} written {len(written)} time(s) ({written})"))
    problems.extend(_dropped_problems(q, owner_of))
    problems.extend(_fp8_problems(q, owner_of, tally, exporter))
    return problems


def _involves(q: QuantizedModel, exporter: str) -> int:
    """How many modules of ``q`` are claimed by (or exported with) ``exporter``."""
    return len(
        {c.name for c in q.claims if c.exporter == exporter}
        | {c.module_name for c in q.calls if c.exporter == exporter}
    )


def _check_spec(case: ExporterCase, spec: ModelSpec, state: tuple[Any, ...], tally: _Tally) -> None:
    for recipe in GENERATED_RECIPES:
        try:
            q = _generated_survey(spec, recipe, case.seed, state)
        except Exception as err:
            raise GeneratedFailure(
                spec, f"quantizing with {recipe} raised {error_text(err)}", recipe=recipe
            ) from err
        if isinstance(q, str):
            tally.not_fitting[recipe] += 1
            continue
        tally.quantized_models += 1
        involved = _involves(q, case.name)
        if not involved:
            continue
        tally.claimed += involved
        mine = [
            text
            for who, text in _quantized_problems(q, tally, case.name)
            if who in (None, case.name)
        ]
        if mine:
            raise GeneratedFailure(
                spec, f"{case.name} with recipe {recipe}: {_listed(mine)}", recipe=recipe
            )


@check("quantized_generated", scope="exporter")
@aborts_to_result
def quantized_generated(case: ExporterCase) -> CheckResult:
    """Generated structures, quantized, are exported completely and exactly.

    Hypothesis draws :data:`GENERATED_EXAMPLES` structures (or the ``max_examples``
    of a profile chosen with ``--hypothesis-profile``;
    :func:`~pytest_exportcheck.strategies.model_specs`), each quantized with
    every recipe of :data:`GENERATED_RECIPES` that fits (``fp8``, ``nvfp4``,
    ``int4_awq``, ``int8_wo``, ``fp8+fp8_kv``) and exported with
    ``export_quantized_state`` through a recording copy of the registry (as the
    survey does). Where this exporter claims a module:

    - every quantized module is exported exactly once (registry-wide);
    - every parameter reaches the checkpoint: under its own name, or for a module
      an exporter claims, under the names the built-in layout gives it
      (``QuantLinear``: ``{name}.weight``; stacked experts:
      ``{name}.{e}.{gate,up,down}_proj.weight``), or (other types) something under
      the module's prefix;
    - each tied group (one ``Parameter`` under several names) is written once;
    - FP8 weights: the exported ``weight`` (float8_e4m3fn) times ``weight_scale``,
      in float32, equals ``TensorQuantizer.fake_quant`` of the module's weight
      **bit for bit** (tolerance 0). That comparison is exact on purpose: both are
      the same elementwise function (FP8 code times the same float32 scale) of
      identical inputs, with no matmul or reduction in between.

    Skips, with the reason, for an exporter that claims nothing in the generated
    models. A failure shrinks to the smallest structure, printed as JSON (and
    written to a file) with an ``exportlm export --target hf_checkpoint
    --quantize RECIPE --model FILE.json`` command that rebuilds and exports it.
    """
    exporter_entry(case)
    state = _registry_state()
    tally = _Tally()
    budget = generated_budget()
    start = time.perf_counter()

    @model_settings(max_examples=budget, database=None)
    @given(spec=model_specs())
    def prop(spec: ModelSpec) -> None:
        _check_spec(case, spec, state, tally)

    failure = _run(_shared_seed(prop))
    seconds = round(time.perf_counter() - start, 2)
    if failure is not None:
        spec_file = _write_spec(case.workdir, f"quantized_generated-{case.name}", failure.spec)
        recipe = str(failure.details.get("recipe", "fp8"))
        command = repro_command(
            "hf_checkpoint", spec_file, case.workdir / "repro" / "checkpoint", seed=case.seed
        ).replace(" --verify", f" --quantize {shlex.quote(recipe)} --verify")
        return _failure_result(
            failure,
            f"module exporter {case.name!r} on a generated quantized model:",
            spec_file,
            command,
        )
    if not tally.claimed:
        return CheckResult.skipped(
            f"module exporter {case.name!r} claims no module of the generated models "
            f"({tally.quantized_models} quantized models from {budget} drawn "
            f"structures x {', '.join(GENERATED_RECIPES)})"
        )
    return CheckResult.passed(
        f"{tally.claimed} module(s) claimed by {case.name} in {tally.quantized_models} quantized "
        f"generated models; {tally.fp8_weights} of its FP8 weights bit-identical to fake quant; "
        f"{seconds} s",
        claimed=tally.claimed,
        fp8_weights=tally.fp8_weights,
        seconds=seconds,
    )
