"""Checks of module exporters (scope ``"exporter"``), run for every exporter by name.

``case.name`` is a name in ``exportlm.modules.MODULE_EXPORTER_REGISTRY``; the
exporter's dispatch entry (keys, predicate, position) is read from
``EXPORT_MODULE_REGISTRY``. Registry experiments run on copies; the global
registry is never modified.

Examples of what an exporter claims come from the toy models quantized with
every recipe (:mod:`._survey`) and from the exporter's optional
``conformance_examples()`` method: a third-party exporter for module types the
toy models do not contain returns a few instances of them there, e.g.::

    class MyExporter(ModuleExporter):
        keys = ("MyQuantConv",)

        def conformance_examples(self) -> list[nn.Module]:
            return [quantize(MyConvModel(), "fp8").conv]

Checks that need examples skip, with that reason, when there are none.
"""

from __future__ import annotations

import copy
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from hypothesis import given
from torch import nn

from exportlm.errors import ExportLMError, TiedWeightsError
from exportlm.models import build_model
from exportlm.modules import (
    DictSink,
    ExportContext,
    ExporterEntry,
    ModuleExporter,
    export_quantized_state,
    resolve_tied_weights,
)
from exportlm.quant import is_quantized_module
from pytest_exportcheck.checks._api import CheckResult, ExporterCase, check
from pytest_exportcheck.checks._support import CheckAbort, aborts_to_result, error_text
from pytest_exportcheck.checks._survey import (
    SCALE_LEAVES,
    ExportCall,
    QuantizedModel,
    Survey,
    copy_registry,
    exporter_entry,
    survey_for,
)
from pytest_exportcheck.strategies import model_settings, module_class_trees, reclass

__all__ = [
    "EXAMPLES_HOOK",
    "claims_all_quantized",
    "export_contract",
    "moe_inputs",
    "mro_match",
    "name_match",
    "precedence",
    "predicate_match",
    "reachable",
    "tensor_problems",
    "tied_weights",
]

#: Name of the optional exporter method returning example modules it claims.
EXAMPLES_HOOK = "conformance_examples"
#: Generated classes per example type in ``mro_match`` / ``name_match``.
_EXAMPLES_PER_TYPE = 20
_MAX_LISTED = 8


class _Mismatch(AssertionError):
    """A property of a Hypothesis-driven check does not hold."""


# ----------------------------------------------------------------------------- shared helpers


def _listed(items: Iterable[str]) -> str:
    items = list(items)
    text = "; ".join(items[:_MAX_LISTED])
    return text + (f"; ... ({len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else "")


def _hook_examples(case: ExporterCase, exporter: ModuleExporter) -> list[nn.Module]:
    hook = getattr(exporter, EXAMPLES_HOOK, None)
    if hook is None:
        return []
    try:
        examples = list(hook())
    except Exception as err:
        raise CheckAbort(
            CheckResult.failed(f"{case.name}.{EXAMPLES_HOOK}() raised {error_text(err)}")
        ) from err
    bad = [type(e).__name__ for e in examples if not isinstance(e, nn.Module)]
    if bad:
        raise CheckAbort(
            CheckResult.failed(f"{case.name}.{EXAMPLES_HOOK}() returned non-modules: {bad}")
        )
    return examples


def _examples(
    case: ExporterCase, exporter: ModuleExporter, survey: Survey
) -> list[tuple[str, nn.Module]]:
    """``(label, module)`` claimed by the exporter: one per module type, then the hook's."""
    seen: set[type] = set()
    found: list[tuple[str, nn.Module]] = []
    for claim in survey.claims_of(case.name):
        if type(claim.module) not in seen:
            seen.add(type(claim.module))
            found.append((f"{claim.model}/{claim.recipe}:{claim.name}", claim.module))
    for i, module in enumerate(_hook_examples(case, exporter)):
        found.append((f"{EXAMPLES_HOOK}()[{i}]", module))
    return found


def _no_examples(case: ExporterCase, survey: Survey) -> CheckResult:
    return CheckResult.skipped(
        f"module exporter {case.name!r} claims no module of the toy models "
        f"({', '.join(survey.models)} x each recipe) and has no {EXAMPLES_HOOK}() method"
    )


def _run_property(prop: Callable[[], None]) -> str | None:
    """Run a Hypothesis-decorated property; the failure text, or ``None`` when it holds."""
    try:
        prop()
    except _Mismatch as err:
        return str(err)
    return None


def _label(exporter: ModuleExporter | None) -> str:
    return "no exporter" if exporter is None else repr(exporter)


def _string_keys() -> set[str]:
    return {k for e in copy_registry().entries() for k in e.keys if isinstance(k, str)}


# ----------------------------------------------------------------------------- mro_match


def _subclass_property(
    registry: Any, exporter: ModuleExporter, module: nn.Module, label: str, avoid: set[str]
) -> Callable[[], None]:
    @model_settings(max_examples=_EXAMPLES_PER_TYPE, database=None)
    @given(module_class_trees([type(module)], avoid=avoid))
    def prop(cls: type) -> None:
        got = registry.match(reclass(module, cls))
        if got is not exporter:
            mro = " -> ".join(c.__name__ for c in cls.__mro__[:6])
            raise _Mismatch(
                f"a subclass {cls.__name__} of {type(module).__name__} ({label}; MRO {mro}) "
                f"is dispatched to {_label(got)}, not {exporter!r}"
            )

    return prop  # type: ignore[no-any-return]


@check("mro_match", scope="exporter")
@aborts_to_result
def mro_match(case: ExporterCase) -> CheckResult:
    """Generated subclasses of every module type the exporter claims are still claimed by it.

    For each claimed type, Hypothesis builds chains of new subclasses (random
    names, some with a mixin, never a name any entry uses as a key) and moves an
    instance onto them: dispatch must still pick this exporter, since a class key
    matches anywhere in the MRO and a name key matches the original class's name
    there. Fails with the falsifying class and the exporter it went to instead.
    """
    exporter, _, _ = exporter_entry(case)
    survey = survey_for(case)
    examples = _examples(case, exporter, survey)
    if not examples:
        return _no_examples(case, survey)
    registry = copy_registry()
    avoid = _string_keys()
    for label, module in examples:
        failure = _run_property(_subclass_property(registry, exporter, module, label, avoid))
        if failure:
            return CheckResult.failed(failure)
    return CheckResult.passed(
        f"{len(examples)} claimed type(s), generated subclasses still claimed"
    )


# ----------------------------------------------------------------------------- name_match


_NEUTRAL_BASES: tuple[type[nn.Module], ...] = (nn.Module, nn.Identity)


def _neutral_bases(entry: ExporterEntry) -> list[type[nn.Module]]:
    """Bases none of the entry's keys match (so only a substring bug could match them)."""
    bases = []
    for base in _NEUTRAL_BASES:
        names = {c.__name__ for c in base.__mro__}
        if any((k in base.__mro__) if isinstance(k, type) else (k in names) for k in entry.keys):
            continue
        bases.append(base)
    return bases


@check("name_match", scope="exporter")
@aborts_to_result
def name_match(case: ExporterCase) -> CheckResult:
    """Class names are matched exactly: a name merely containing a key is not claimed.

    Hypothesis generates unrelated module classes (subclasses of ``nn.Module`` /
    ``nn.Identity`` that no key of the entry matches) whose names embed the
    exporter's string keys, its class keys' names and the names of the types it
    claims, e.g. ``MyQuantLinearV2`` or ``QuantLinearMoE``. None may be claimed by
    this exporter: dispatch on ``"QuantLinear" in type(m).__name__`` fails here,
    whether it hides in a key or in a predicate.
    """
    exporter, entry, _ = exporter_entry(case)
    survey = survey_for(case)
    words = {k if isinstance(k, str) else k.__name__ for k in entry.keys}
    words |= {type(m).__name__ for _, m in _examples(case, exporter, survey)}
    if not words:
        return CheckResult.skipped(
            f"module exporter {case.name!r} has no keys and claims no module: no name to test"
        )
    bases = _neutral_bases(entry)
    if not bases:
        return CheckResult.skipped(f"{entry.describe()} matches every nn.Module by its keys")
    registry = copy_registry()

    @model_settings(max_examples=2 * _EXAMPLES_PER_TYPE, database=None)
    @given(module_class_trees(bases, contains=sorted(words), avoid=_string_keys() | words))
    def prop(cls: type) -> None:
        got = registry.match(cls())
        if got is exporter:
            raise _Mismatch(
                f"{exporter!r} claims {cls.__name__} (MRO "
                f"{', '.join(c.__name__ for c in cls.__mro__)}), which only contains one of "
                f"{sorted(words)} as a substring; match class names exactly, never by substring"
            )

    failure = _run_property(prop)
    if failure:
        return CheckResult.failed(failure)
    return CheckResult.passed(f"names embedding {sorted(words)} are not claimed")


# ----------------------------------------------------------------------------- predicate_match


def _all_modules(
    survey: Survey, examples: list[tuple[str, nn.Module]]
) -> Iterable[tuple[str, nn.Module]]:
    for q in survey.quantized:
        for name, module in q.model.named_modules():
            yield f"{q.model_name}/{q.recipe}:{name}", module
    yield from examples


@check("predicate_match", scope="exporter")
@aborts_to_result
def predicate_match(case: ExporterCase) -> CheckResult:
    """An entry with a predicate claims a module only when keys and predicate both match.

    For every module of every quantized toy model (and the exporter's examples),
    a registry holding only this entry must claim it exactly when some key
    matches (or there are no keys) *and* the predicate returns true. The
    predicate must not raise on a module its keys select (for a predicate-only
    entry: on any module) and must give the same answer twice.
    """
    exporter, entry, _ = exporter_entry(case)
    if entry.predicate is None:
        return CheckResult.skipped(f"{entry.describe()} has no predicate; keys alone decide")
    survey = survey_for(case)
    examples = _examples(case, exporter, survey)
    single = copy_registry([entry])
    counts = {"keys": 0, "predicate": 0, "claimed": 0}
    problems: list[str] = []
    for label, module in _all_modules(survey, examples):
        keys_ok = entry.keys_match(type(module))
        counts["keys"] += keys_ok
        if not keys_ok:
            if single.match(module) is exporter:
                problems.append(f"{label}: claimed although no key matches {type(module).__name__}")
            continue
        try:
            first, second = bool(entry.predicate(module)), bool(entry.predicate(module))
        except Exception as err:
            problems.append(f"{label}: the predicate raised {type(err).__name__}: {err}")
            continue
        if first != second:
            problems.append(f"{label}: the predicate answered {first} then {second}")
        counts["predicate"] += first
        claimed = single.match(module) is exporter
        counts["claimed"] += claimed
        if claimed != first:
            problems.append(f"{label}: keys match, predicate is {first}, but claimed={claimed}")
    if problems:
        return CheckResult.failed(f"{entry.describe()}: {_listed(problems)}", **counts)
    return CheckResult.passed(
        f"{counts['keys']} key matches, {counts['predicate']} accepted by the predicate, "
        f"{counts['claimed']} claimed",
        **counts,
    )


# ----------------------------------------------------------------------------- precedence


def _probe(entry: ExporterEntry) -> ModuleExporter:
    """A fresh exporter of its own class, with the same keys as ``entry``."""

    class PrecedenceProbe(ModuleExporter):
        name = "exportcheck_precedence_probe"

        def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
            return None

    return PrecedenceProbe()


@check("precedence", scope="exporter")
@aborts_to_result
def precedence(case: ExporterCase) -> CheckResult:
    """Order is stable; re-registration replaces in place; ``prepend`` goes first.

    On copies of the registry: a copy keeps the order; registering the exporter
    again keeps its position and the number of entries; a probe exporter with the
    same keys registered with ``prepend=True`` becomes entry 0 and wins every
    module the exporter claims, while appended it wins none of them (first match
    wins).
    """
    exporter, entry, index = exporter_entry(case)
    survey = survey_for(case)
    modules = [m for _, m in _examples(case, exporter, survey)]
    registry = copy_registry()
    order = registry.exporters()
    problems: list[str] = []
    if order != copy_registry().exporters():
        problems.append("two copies of the registry list the exporters in different orders")
    registry.register(exporter, *entry.keys, predicate=entry.predicate)
    if registry.exporters() != order:
        problems.append(f"registering {exporter!r} again moved it or added an entry")
    probe = _probe(entry)
    registry.register(probe, *entry.keys, predicate=entry.predicate, prepend=True)
    if registry.exporters()[0] is not probe or registry.exporters()[index + 1] is not exporter:
        problems.append("prepend=True did not put the new entry first, before all others")
    registry.register(exporter, *entry.keys, predicate=entry.predicate)
    if registry.exporters()[index + 1] is not exporter:
        problems.append("an in-place replacement after a prepend moved the exporter")
    stolen = [type(m).__name__ for m in modules if registry.match(m) is not probe]
    if stolen:
        problems.append(f"a prepended entry with the same keys did not win {stolen}")
    appended = copy_registry()
    appended.register(probe, *entry.keys, predicate=entry.predicate)
    if appended.exporters()[-1] is not probe:
        problems.append("a new entry was not appended last")
    lost = [type(m).__name__ for m in modules if appended.match(m) is not exporter]
    if lost:
        problems.append(
            f"an appended entry with the same keys took {lost} away (first match must win)"
        )
    if problems:
        return CheckResult.failed(f"{entry.describe()}: " + "; ".join(problems))
    note = f" on {len(modules)} claimed type(s)" if modules else " (order only: no claimed module)"
    return CheckResult.passed(f"entry {index}: order, replacement and prepend honoured{note}")


# ----------------------------------------------------------------------------- reachable


def _covers(earlier: ExporterEntry, key: Any) -> bool:
    """Whether every module matched by ``key`` is also matched by ``earlier``'s keys."""
    if earlier.predicate is not None or not earlier.keys:
        return False
    if isinstance(key, type):
        names = {c.__name__ for c in key.__mro__}
        return any(k in key.__mro__ if isinstance(k, type) else k in names for k in earlier.keys)
    return key in earlier.keys


@check("reachable", scope="exporter")
@aborts_to_result
def reachable(case: ExporterCase) -> CheckResult:
    """The exporter is not fully shadowed by earlier entries for its own keys.

    Passes when it claims some module of the toy models or its examples. Otherwise
    each of its keys must not be covered by an earlier predicate-free entry (a class
    key is covered by an earlier key in its MRO, a name key by the same name
    earlier); if all are, no module can ever reach it and the check fails naming
    the shadowing entries.
    """
    _, entry, index = exporter_entry(case)
    survey = survey_for(case)
    claims = survey.claims_of(case.name)
    if claims:
        return CheckResult.passed(f"claims {len(claims)} module(s) of the toy models")
    earlier = copy_registry().entries()[:index]
    shadows: dict[str, str] = {}
    for key in entry.keys:
        for other in earlier:
            if _covers(other, key):
                shadows[key if isinstance(key, str) else key.__name__] = other.describe()
                break
    if entry.keys and len(shadows) == len(entry.keys):
        return CheckResult.failed(
            f"{entry.describe()} (entry {index}) is unreachable: every key is taken first by "
            + "; ".join(f"{k!r} by {v}" for k, v in shadows.items())
            + ". Register it with prepend=True, or narrow the earlier entry with a predicate"
        )
    return CheckResult.passed(f"entry {index} is not shadowed (it claims no toy-model module)")


# ----------------------------------------------------------------------------- claims_all_quantized


@check("claims_all_quantized", scope="exporter")
@aborts_to_result
def claims_all_quantized(case: ExporterCase) -> CheckResult:
    """Every quantized module of every toy model is claimed by exactly one exporter.

    Registry-wide (the same verdict in every exporter's row): each toy model is
    quantized with each recipe that fits it and exported by the driver; no
    quantized module may be left unclaimed and no tensor may be written twice
    (two exporters claiming the same weights). The row also fails when this
    exporter claims a quantized module and writes nothing for it.
    """
    exporter_entry(case)
    survey = survey_for(case)
    unclaimed = [
        f"{c.model}/{c.recipe}: {c.name} ({type(c.module).__name__})"
        for q in survey.quantized
        for c in q.claims
        if c.quantized and c.exporter is None
    ]
    driver_errors = [
        f"{q.model_name}/{q.recipe}: {q.error.splitlines()[0]}"
        for q in survey.quantized
        if q.error and "written twice" in q.error
    ]
    dropped = [
        f"{c.model}/{c.recipe}: {c.module_name}"
        for c in survey.calls_of(case.name)
        if c.quantized and not c.names and c.error is None
    ]
    problems = []
    if unclaimed:
        problems.append(
            f"registry-wide: {len(unclaimed)} quantized module(s) unclaimed: {_listed(unclaimed)}"
        )
    if driver_errors:
        problems.append(f"registry-wide: {_listed(driver_errors)}")
    if dropped:
        problems.append(
            f"{case.name} claims quantized modules but writes nothing: {_listed(dropped)}"
        )
    total = sum(1 for q in survey.quantized for c in q.claims if c.quantized)
    if problems:
        return CheckResult.failed("; ".join(problems), unclaimed=len(unclaimed))
    return CheckResult.passed(
        f"{total} quantized modules in {len(survey.quantized)} quantized models, each claimed once; "
        f"{len(survey.claims_of(case.name))} by {case.name}",
        quantized_modules=total,
    )


# ----------------------------------------------------------------------------- export_contract


def tensor_problems(name: str, tensor: torch.Tensor) -> list[str]:
    """NaN/inf in any floating tensor (FP8 included); a zero in a scale tensor."""
    problems: list[str] = []
    if tensor.is_floating_point():
        values = tensor.detach().float()
        if not bool(torch.isfinite(values).all()):
            problems.append(f"{name} holds NaN/inf")
        if name.rsplit(".", 1)[-1] in SCALE_LEAVES and bool((values == 0).any()):
            problems.append(f"{name} holds a zero scale")
    return problems


def _call_problems(call: ExportCall, q: QuantizedModel) -> list[str]:
    where = f"{call.model}/{call.recipe}: {call.module_name} ({call.module_type})"
    if call.error is not None:
        return [f"{where}: export raised {call.error.splitlines()[0]}"]
    problems: list[str] = []
    prefix = f"{call.module_name}." if call.module_name else ""
    outside = [n for n in call.names if not n.startswith(prefix)]
    if outside:
        problems.append(f"{where}: wrote outside its prefix {prefix!r}: {outside[:4]}")
    if call.mutated:
        problems.append(f"{where}: modified the module ({list(call.mutated)[:4]})")
    for name in call.names:
        problems.extend(f"{where}: {p}" for p in tensor_problems(name, q.tensors[name]))
    return problems


def _zeroed(module: nn.Module) -> nn.Module:
    """A deep copy whose float weights and calibrated amax are all zero."""
    clone = copy.deepcopy(module)
    with torch.no_grad():
        for param in clone.parameters():
            if param.is_floating_point():
                param.zero_()
        for name, buf in clone.named_buffers():
            if name.rsplit(".", 1)[-1] == "amax" and buf.is_floating_point():
                buf.zero_()
    return clone


def _direct_export(exporter: ModuleExporter, name: str, module: nn.Module) -> list[str]:
    """Export ``module`` alone in a fresh context; problems of its tensors (errors included)."""
    sink = DictSink()
    ctx = ExportContext(model=module, sink=sink)
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    try:
        exporter.prepare_moe_inputs(name, module, ctx)
        exporter.export(name, module, ctx)
    except ExportLMError:
        return []  # a clear refusal (e.g. of a zero amax) is allowed
    except Exception as err:
        return [f"{name}: export raised {type(err).__name__}: {err}"]
    problems = [p for n, t in sink.tensors.items() for p in tensor_problems(n, t)]
    outside = [n for n in sink.tensors if not n.startswith(f"{name}.")]
    if outside:
        problems.append(f"{name}: wrote outside its prefix: {outside[:4]}")
    after = module.state_dict()
    if set(after) != set(before) or any(not torch.equal(before[k], after[k]) for k in before):
        problems.append(f"{name}: modified the module")
    return problems


@check("export_contract", scope="exporter")
@aborts_to_result
def export_contract(case: ExporterCase) -> CheckResult:
    """Exports write only under the module's prefix, leave it unchanged, and emit sane tensors.

    Over every export call the driver makes to this exporter on the quantized toy
    models: no exception; every tensor name starts with ``<module name>.``; the
    module's parameters and buffers are unchanged afterwards; no NaN/inf in any
    floating tensor; no zero in a scale (``weight_scale``, ``weight_scale_2``,
    ``input_scale``, ``k_scale``, ``v_scale``). Then once per claimed type (and
    ``conformance_examples()``) on a copy with all-zero weights and amax: a zero
    amax must give a safe scale or a clear ``ExportLMError``, never a zero or
    NaN scale.
    """
    exporter, _, _ = exporter_entry(case)
    survey = survey_for(case)
    examples = _examples(case, exporter, survey)
    calls = survey.calls_of(case.name)
    if not calls and not examples:
        return _no_examples(case, survey)
    by_model = {(q.model_name, q.recipe): q for q in survey.quantized}
    problems = [p for c in calls for p in _call_problems(c, by_model[(c.model, c.recipe)])]
    hooks = _hook_examples(case, exporter)
    for i, module in enumerate(hooks):
        problems.extend(_direct_export(exporter, f"example{i}", module))
    for label, module in examples:
        if is_quantized_module(module):
            problems.extend(
                f"zero amax, {label}: {p}"
                for p in _direct_export(exporter, "zeroed", _zeroed(module))
            )
    if problems:
        return CheckResult.failed(f"{case.name}: {_listed(problems)}", problems=len(problems))
    written = sum(len(c.names) for c in calls)
    return CheckResult.passed(
        f"{len(calls)} export call(s), {written} tensors, {len(hooks)} example(s)"
    )


# ----------------------------------------------------------------------------- moe_inputs


_EXPERT_SCALE = re.compile(
    r"^(?P<block>.+)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\."
    r"(?P<leaf>input_scale|weight_scale|weight_scale_2)$"
)
_GATE_UP = (("gate_proj", "up_proj"), ("w1", "w3"))


def _owned_names(q: QuantizedModel, calls: list[ExportCall]) -> set[str]:
    """Names written by the calls, or under the expert containers (``*experts``) they exported."""
    names: set[str] = set()
    for call in calls:
        names.update(call.names)
        if call.module_name.rsplit(".", 1)[-1].endswith("experts"):
            prefix = f"{call.module_name}."
            names.update(n for n in q.tensors if n.startswith(prefix))
    return names


def _moe_problems(q: QuantizedModel, names: set[str]) -> tuple[int, list[str]]:
    scales: dict[tuple[str, str, str], dict[int, torch.Tensor]] = defaultdict(dict)
    for name in names:
        m = _EXPERT_SCALE.match(name)
        if m:
            scales[(m["block"], m["proj"], m["leaf"])][int(m["expert"])] = q.tensors[name]
    problems: list[str] = []
    where = f"{q.model_name}/{q.recipe}"
    for (block, proj, leaf), per_expert in sorted(scales.items()):
        values = list(per_expert.values())
        if leaf == "input_scale" and any(not torch.equal(values[0], v) for v in values[1:]):
            problems.append(f"{where}: experts of {block} have different {proj}.input_scale")
    for (block, gate, leaf), per_expert in sorted(scales.items()):
        for pair in _GATE_UP:
            if gate != pair[0] or leaf not in ("weight_scale", "weight_scale_2"):
                continue
            up = scales.get((block, pair[1], leaf), {})
            for expert, g in per_expert.items():
                u = up.get(expert)
                if u is not None and g.numel() == 1 and u.numel() == 1 and not torch.equal(g, u):
                    problems.append(
                        f"{where}: {block}.{expert} {pair[0]}/{pair[1]} differ in {leaf}"
                    )
    return len(scales), problems


@check("moe_inputs", scope="exporter")
@aborts_to_result
def moe_inputs(case: ExporterCase) -> CheckResult:
    """Experts of one block share ``input_scale``; gate and up of one expert share ``weight_scale``.

    Reads the per-expert scales (``<block>.<e>.<proj>.input_scale`` /
    ``weight_scale`` / ``weight_scale_2``) written by this exporter, or under an
    expert container (a module named ``*experts``) it claims, in the quantized MoE toy models. Per-tensor
    (one-element) weight scales of gate and up must be equal; for NVFP4 that is
    ``weight_scale_2``. Skips when the exporter writes no expert scales.
    """
    exporter_entry(case)
    survey = survey_for(case)
    groups = 0
    problems: list[str] = []
    for q in survey.quantized:
        calls = [c for c in q.calls if c.exporter == case.name]
        if calls:
            n, found = _moe_problems(q, _owned_names(q, calls))
            groups += n
            problems.extend(found)
    if not groups:
        return CheckResult.skipped(
            f"module exporter {case.name!r} writes no MoE expert scales in the toy models"
        )
    if problems:
        return CheckResult.failed(f"{case.name}: {_listed(problems)}", problems=len(problems))
    return CheckResult.passed(f"{groups} expert scale groups consistent")


# ----------------------------------------------------------------------------- tied_weights


def _tie_groups(model: nn.Module) -> list[list[str]]:
    groups: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        groups[id(param)].append(name)
    return [names for names in groups.values() if len(names) > 1]


def _is_written(name: str, q: QuantizedModel) -> bool:
    if name in q.tensors:
        return True
    owner = name.rpartition(".")[0]
    return any(c.module_name and (owner + ".").startswith(c.module_name + ".") for c in q.calls)


def _tie_problems(q: QuantizedModel) -> list[str]:
    where = f"{q.model_name}/{q.recipe}"
    if q.error is not None:
        return [f"{where}: export raised {q.error.splitlines()[0]}"]
    problems: list[str] = []
    tied: set[str] = set()
    for group in _tie_groups(q.model):
        tied.update(group)
        written = [n for n in group if n in q.tensors]
        if len(written) != 1:
            problems.append(f"{where}: tied {group} written {len(written)} time(s) ({written})")
    for name, _ in q.model.named_parameters():
        if name not in tied and not _is_written(name, q):
            problems.append(f"{where}: real weight {name} was dropped")
    return problems


def _untied_copy(model_name: str, seed: int) -> tuple[nn.Module, str] | None:
    model = build_model(model_name, seed=seed)
    groups = _tie_groups(model)
    if not groups:
        return None
    target = groups[0][-1]
    owner, _, leaf = target.rpartition(".")
    param = model.get_submodule(owner).get_parameter(leaf)
    setattr(
        model.get_submodule(owner), leaf, nn.Parameter(param.detach() + 0.5, requires_grad=False)
    )
    return model, target


@check("tied_weights", scope="exporter")
@aborts_to_result
def tied_weights(case: ExporterCase) -> CheckResult:
    """Tied weights are written once, by name; no real weight is dropped; differing ties raise.

    For each quantized toy model with tied parameters in which this exporter
    exports something: each tied group (one ``Parameter`` under several names) is
    written exactly once, and every other parameter is written (or exported by an
    exporter that owns its module). Then a copy whose declared tie was broken
    (the tied target given other values) must make ``export_quantized_state``
    raise :class:`~exportlm.errors.TiedWeightsError`.
    """
    exporter_entry(case)
    survey = survey_for(case)
    relevant = [
        q
        for q in survey.quantized
        if _tie_groups(q.model) and any(c.exporter == case.name for c in q.calls)
    ]
    if not relevant:
        return CheckResult.skipped(
            f"module exporter {case.name!r} exports nothing in a tied toy model "
            f"(selected: {', '.join(survey.models)})"
        )
    problems = [p for q in relevant for p in _tie_problems(q)]
    for model_name in sorted({q.model_name for q in relevant}):
        untied = _untied_copy(model_name, case.seed)
        if untied is None or not resolve_tied_weights(build_model(model_name, seed=case.seed)):
            continue
        model, target = untied
        try:
            export_quantized_state(model, DictSink())
        except TiedWeightsError:
            continue
        except Exception as err:
            problems.append(
                f"{model_name} with {target} untied: raised {type(err).__name__}, not TiedWeightsError"
            )
            continue
        problems.append(
            f"{model_name} with {target} changed but still declared tied: exported without error"
        )
    if problems:
        return CheckResult.failed(f"{case.name}: {_listed(problems)}", problems=len(problems))
    return CheckResult.passed(f"{len(relevant)} tied quantized model(s): one copy, nothing dropped")
