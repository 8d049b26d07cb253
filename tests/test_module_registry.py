"""ExportModuleRegistry: one test per dispatch rule, through the public API only."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch import nn

from exportlm.errors import PluginLoadError, RegistryConflictError, UnknownNameError
from exportlm.module_exporters import (
    EXPORT_MODULE_REGISTRY,
    ExportContext,
    ExportModuleRegistry,
    ModuleExporter,
    builtin_module_exporters,
    ensure_module_exporters_registered,
    register_builtin_module_exporters,
)
from exportlm.quant import QuantLinear, QuantMoELinear
from exportlm.registry import PluginWarning, load_entry_point_registry
from tests._distinfo import make_distribution


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


def test_match_and_explain_are_the_same_walk_asking_each_predicate_once() -> None:
    asked: list[str] = []
    registry = ExportModuleRegistry()
    registry.register(ExpA(), Base, predicate=lambda m: asked.append("a") is not None)
    b = registry.register(ExpB(), Child)
    module = Child()
    assert registry.match(module) is b  # the type's walk is cached now
    assert asked == ["a"]
    why = registry.explain(module)
    assert asked == ["a", "a"]
    assert (why.exporter, why.index) == (b, 1)
    assert len(why.rejected) == 1
    assert why.rejected[0].endswith(": predicate returned False")
    assert why.reason.startswith("Child matched entry 1 (")
    assert why.reason.endswith(") by a key in its MRO")


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
            "dbrx_experts",
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
        assert EXPORT_MODULE_REGISTRY.entry(exporter.display_name).builtin


# -- one registry: names, provenance and dispatch in one entry ----------------------


def test_one_registry_holds_names_provenance_and_dispatch() -> None:
    ensure_module_exporters_registered()
    entry = EXPORT_MODULE_REGISTRY.entry("quant_linear")
    assert entry.exporter is EXPORT_MODULE_REGISTRY.get("quant_linear")
    assert entry.keys == ("QuantLinear",)
    assert entry.provider == "exportlm (built in)"
    position = [e.name for e in EXPORT_MODULE_REGISTRY.entries()].index("quant_linear")
    assert EXPORT_MODULE_REGISTRY.exporters()[position] is entry.exporter


def test_entries_carry_their_names_in_match_order_and_names_are_sorted() -> None:
    registry = ExportModuleRegistry()
    registry.register(ExpB(), Base)
    registry.register(ExpA(), Child, prepend=True)
    assert [e.name for e in registry.entries()] == ["a", "b"]  # match order
    registry.register(ExpC(), Base, name="zz_custom", prepend=True)
    assert [e.name for e in registry.entries()] == ["zz_custom", "a", "b"]
    assert registry.names() == ["a", "b", "zz_custom"]  # sorted, as every registry
    assert "zz_custom" in registry
    assert registry.get("zz_custom") in registry


class Declared(_Exp):
    name = "declared"
    keys = (Child,)
    prepend = True


def test_name_form_registers_the_keys_and_prepend_the_class_declares() -> None:
    registry = ExportModuleRegistry()
    registry.register(ExpA(), Base)
    declared = registry.register("by_name", Declared())
    assert registry.entries()[0].name == "by_name"
    assert registry.entries()[0].keys == (Child,)
    assert registry.match(Child()) is declared
    with pytest.raises(ValueError, match="needs match keys or a predicate"):
        registry.register("no_keys", ExpB())
    with pytest.raises(TypeError, match="takes the exporter only"):
        registry.register("x", ExpB(), Base)  # type: ignore[call-overload]


def test_another_exporter_under_a_taken_name_conflicts_naming_both_owners() -> None:
    registry = ExportModuleRegistry()
    register_builtin_module_exporters(registry)
    with pytest.raises(RegistryConflictError, match="quant_linear") as info:
        registry.register(ExpA(), Base, name="quant_linear")
    assert "exportlm (built in)" in str(info.value)
    assert [e.name for e in registry.entries()].count("quant_linear") == 1


def test_reregistering_keeps_the_name_unless_a_new_one_is_given() -> None:
    registry = ExportModuleRegistry()
    registry.register(ExpA(), Base, name="first")
    registry.register(ExpA(), Child)  # same class: replaced in place, name kept
    assert [(e.name, e.keys) for e in registry.entries()] == [("first", (Child,))]
    registry.register(ExpA(), Child, name="renamed")
    assert registry.names() == ["renamed"]


def test_unregister_by_name_instance_or_class() -> None:
    registry = ExportModuleRegistry()
    a, b = registry.register(ExpA(), Base), registry.register(ExpB(), Base)
    c = registry.register(ExpC(), Base)
    registry.unregister("a")
    registry.unregister(b)
    registry.unregister(ExpC)
    assert len(registry) == 0
    assert a not in registry
    assert c not in registry
    with pytest.raises(UnknownNameError):
        registry.unregister("a")
    with pytest.raises(KeyError):
        registry.unregister(a)


def test_restore_puts_back_a_snapshot_with_names_and_provenance() -> None:
    registry = ExportModuleRegistry()
    register_builtin_module_exporters(registry)
    snapshot = registry.entries()
    registry.unregister("quant_linear")
    registry.register(ExpA(), Base, prepend=True)
    registry.restore(snapshot)
    assert registry.entries() == snapshot
    assert [e.name for e in registry.entries()] == [e.name for e in snapshot]
    assert registry.entry("quant_linear").builtin
    assert registry.match(QuantLinear(4, 4)) is registry.get("quant_linear")


# -- entry points ---------------------------------------------------------------------

_PLUGIN_SOURCE = """
from torch import nn
from exportlm.module_exporters import ModuleExporter


class FrontExporter(ModuleExporter):
    keys = ("Identity",)
    prepend = True

    def export(self, name, module, ctx):
        return None


class KeylessExporter(ModuleExporter):
    def export(self, name, module, ctx):
        return None


class LinearClash(ModuleExporter):
    keys = ("QuantLinear",)

    def export(self, name, module, ctx):
        return None
"""


@pytest.fixture
def plugin_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "site"
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv("EXPORTLM_DISABLE_PLUGINS", raising=False)
    yield root
    sys.modules.pop("plug_exporters", None)


def test_entry_point_exporters_load_by_name_with_declared_keys(plugin_path: Path) -> None:
    group = f"exportlm.test_{uuid.uuid4().hex[:8]}"
    make_distribution(
        plugin_path,
        "exporter-plugin",
        {
            group: {
                "front": "plug_exporters:FrontExporter",
                "keyless": "plug_exporters:KeylessExporter",
                "quant_linear": "plug_exporters:LinearClash",
            }
        },
        {"plug_exporters.py": _PLUGIN_SOURCE},
    )
    registry = ExportModuleRegistry()
    register_builtin_module_exporters(registry)
    with pytest.warns(PluginWarning) as warned:
        loaded = load_entry_point_registry(group, registry, raise_errors=False)
    assert sorted(str(w.message).split("'")[1] for w in warned) == [
        "keyless = plug_exporters:KeylessExporter",
        "quant_linear",
    ]
    assert loaded == ["front"]
    front = registry.entry("front")
    assert registry.entries()[0] is front  # the class declares prepend = True
    assert front.distribution == "exporter-plugin 1.0"
    assert registry.match(nn.Identity()) is front.exporter
    assert isinstance(registry.failed()["keyless"], PluginLoadError)
    assert "declares no match keys" in str(registry.failed()["keyless"])
    assert any(isinstance(e, RegistryConflictError) for e in registry.plugin_errors)
    assert registry.entry("quant_linear").builtin  # the built-in keeps its name


def test_old_room_name_still_imports_and_warns() -> None:
    import importlib

    sys.modules.pop("exportlm.modules", None)
    with pytest.warns(DeprecationWarning, match="exportlm.module_exporters"):
        old = importlib.import_module("exportlm.modules")
    assert old.ModuleExporter is ModuleExporter
    assert old.EXPORT_MODULE_REGISTRY is EXPORT_MODULE_REGISTRY
