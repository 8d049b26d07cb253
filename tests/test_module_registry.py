"""ExportModuleRegistry: one test per dispatch rule, through the public API only."""

from __future__ import annotations

import pytest
from torch import nn

from exportlm.modules import (
    EXPORT_MODULE_REGISTRY,
    MODULE_EXPORTER_REGISTRY,
    ExportContext,
    ExportModuleRegistry,
    ModuleExporter,
    builtin_module_exporters,
    ensure_module_exporters_registered,
    register_builtin_module_exporters,
)
from exportlm.quant import QuantLinear, QuantMoELinear


class _Exp(ModuleExporter):
    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        return None


class ExpA(_Exp):
    name = "a"


class ExpB(_Exp):
    name = "b"


class ExpC(_Exp):
    name = "c"


class Base(nn.Module):
    pass


class Child(Base):
    pass


class BaseLinear(nn.Linear):
    pass


def test_class_key_matches_any_class_in_the_mro() -> None:
    registry = ExportModuleRegistry()
    a = registry.register(ExpA(), Base)
    assert registry.match(Child()) is a
    assert registry.match(Base()) is a
    assert registry.match(nn.Linear(2, 2)) is None


def test_string_key_matches_class_names_exactly_never_substrings() -> None:
    registry = ExportModuleRegistry()
    registry.register(ExpA(), "QuantLinear")
    assert registry.match(QuantLinear(4, 4)) is registry.exporters()[0]
    # QuantMoELinear subclasses QuantLinear, so "QuantLinear" *is* in its MRO by name...
    assert registry.match(QuantMoELinear(4, 4)) is registry.exporters()[0]
    # ...but a name that only contains the key as a substring never matches.
    registry2 = ExportModuleRegistry()
    registry2.register(ExpA(), "Linear")
    assert registry2.match(QuantMoELinear(4, 4)) is registry2.exporters()[0]  # nn.Linear in MRO
    registry3 = ExportModuleRegistry()
    registry3.register(ExpA(), "MoELinear")
    assert registry3.match(QuantMoELinear(4, 4)) is None


def test_name_key_quantmoelinear_does_not_claim_quantlinear_but_class_key_quantlinear_claims_both() -> (
    None
):
    registry = ExportModuleRegistry()
    moe = registry.register(ExpA(), "QuantMoELinear")
    assert registry.match(QuantLinear(4, 4)) is None
    assert registry.match(QuantMoELinear(4, 4)) is moe
    by_class = ExportModuleRegistry()
    exp = by_class.register(ExpB(), QuantLinear)
    assert by_class.match(QuantMoELinear(4, 4)) is exp


def test_first_match_wins_in_registration_order() -> None:
    registry = ExportModuleRegistry()
    a = registry.register(ExpA(), Base)
    registry.register(ExpB(), Child)
    assert registry.match(Child()) is a


def test_predicate_alone_is_asked_per_module() -> None:
    registry = ExportModuleRegistry()
    a = registry.register(ExpA(), predicate=lambda m: getattr(m, "flag", False))
    module = Base()
    assert registry.match(module) is None
    module.flag = True
    assert registry.match(module) is a


def test_keys_and_predicate_must_both_match() -> None:
    registry = ExportModuleRegistry()
    a = registry.register(ExpA(), Base, predicate=lambda m: getattr(m, "flag", False))
    flagged_linear = nn.Linear(2, 2)
    flagged_linear.flag = True  # type: ignore[assignment]
    assert registry.match(flagged_linear) is None  # predicate yes, key no
    child = Child()
    assert registry.match(child) is None  # key yes, predicate no
    child.flag = True
    assert registry.match(child) is a


def test_predicate_rejection_falls_through_to_later_entries() -> None:
    registry = ExportModuleRegistry()
    registry.register(ExpA(), Base, predicate=lambda m: False)
    b = registry.register(ExpB(), Base)
    assert registry.match(Child()) is b


def test_prepend_goes_first() -> None:
    registry = ExportModuleRegistry()
    registry.register(ExpA(), Base)
    b = registry.register(ExpB(), Base, prepend=True)
    assert registry.exporters()[0] is b
    assert registry.match(Child()) is b


def test_reregistering_same_instance_replaces_in_place_keeping_position() -> None:
    registry = ExportModuleRegistry()
    a = registry.register(ExpA(), Child)
    registry.register(ExpB(), Base)
    registry.register(a, Base, prepend=True)  # same instance: position kept, keys replaced
    assert [e.exporter for e in registry.entries()] == [a, registry.exporters()[1]]
    assert registry.entries()[0].keys == (Base,)
    assert len(registry) == 2


def test_reregistering_same_class_replaces_the_old_instance_in_place() -> None:
    registry = ExportModuleRegistry()
    registry.register(ExpA(), Base)
    c = registry.register(ExpC(), Base)
    new_a = registry.register(ExpA(), Child)
    assert registry.exporters() == [new_a, c]


def test_no_match_is_none_and_explain_says_why() -> None:
    registry = ExportModuleRegistry()
    registry.register(ExpA(), Child)
    registry.register(ExpB(), Base, predicate=lambda m: False)
    assert registry.match(nn.Linear(2, 2)) is None
    why = registry.explain(nn.Linear(2, 2))
    assert why.exporter is None
    assert why.index is None
    assert "no exporter matches Linear" in why.reason
    assert len(why.rejected) == 2
    hit = registry.explain(Child())
    assert hit.exporter is registry.exporters()[0]
    assert hit.index == 0
    hit2 = registry.explain(Base())
    assert hit2.exporter is None
    assert "predicate returned False" in str(hit2)


def test_type_cache_is_invalidated_on_register() -> None:
    registry = ExportModuleRegistry()
    a = registry.register(ExpA(), Base)
    assert registry.match(Child()) is a  # cached for Child
    b = registry.register(ExpB(), Child, prepend=True)
    assert registry.match(Child()) is b
    registry.unregister(b)
    assert registry.match(Child()) is a


def test_register_validates_arguments() -> None:
    registry = ExportModuleRegistry()
    with pytest.raises(ValueError, match="needs match keys or a predicate"):
        registry.register(ExpA())
    with pytest.raises(TypeError, match="ModuleExporter instance"):
        registry.register(ExpA, Base)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="classes or class names"):
        registry.register(ExpA(), 3)  # type: ignore[arg-type]


def test_builtin_order_and_names() -> None:
    registry = ExportModuleRegistry()
    exporters = register_builtin_module_exporters(registry)
    names = [e.display_name for e in registry.exporters()]
    assert (
        names
        == [e.display_name for e in exporters]
        == [
            "quant_moe_linear",
            "quant_linear",
            "quant_embedding",
            "bmm_experts",
            "fused_experts",
            "iterable_experts",
            "iterable_catch_all",
        ]
    )
    assert registry.match(QuantMoELinear(4, 4)).display_name == "quant_moe_linear"  # type: ignore[union-attr]
    assert registry.match(QuantLinear(4, 4)).display_name == "quant_linear"  # type: ignore[union-attr]
    assert registry.match(nn.ModuleList()).display_name == "iterable_catch_all"  # type: ignore[union-attr]
    register_builtin_module_exporters(registry)  # idempotent: replaced in place
    assert len(registry) == len(builtin_module_exporters())


def test_ensure_registers_builtins_by_name_and_is_idempotent() -> None:
    ensure_module_exporters_registered()
    before = len(EXPORT_MODULE_REGISTRY)
    ensure_module_exporters_registered()
    assert len(EXPORT_MODULE_REGISTRY) == before
    for exporter in builtin_module_exporters():
        assert MODULE_EXPORTER_REGISTRY.entry(exporter.display_name).builtin
