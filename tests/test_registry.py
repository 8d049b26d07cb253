"""Registry semantics and entry-point discovery through real dist-info metadata."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from exportlm import (
    PluginLoadError,
    Registry,
    RegistryConflictError,
    UnknownNameError,
    load_entry_point_registry,
)
from exportlm.registry import PluginWarning
from tests._distinfo import make_distribution


def a() -> str:
    return "a"


def b() -> str:
    return "b"


def test_register_and_get_round_trip() -> None:
    reg: Registry[object] = Registry("widget")
    assert reg.register("x", a) is a
    assert reg.get("x") is a
    assert "x" in reg
    assert len(reg) == 1
    assert reg.entry("x").provider == "registered in code"


def test_same_object_twice_is_a_no_op_but_a_different_object_conflicts() -> None:
    reg: Registry[object] = Registry("widget")
    reg.register("x", a, builtin=True)
    reg.register("x", a)
    with pytest.raises(RegistryConflictError) as info:
        reg.register("x", b, distribution="thirdparty 2.0")
    message = str(info.value)
    assert "exportlm (built in)" in message
    assert "thirdparty 2.0" in message
    assert reg.get("x") is a


def test_unknown_name_lists_available_sorted_and_is_a_value_error() -> None:
    reg: Registry[object] = Registry("widget")
    for name in ("zeta", "alpha", "mid"):
        reg.register(name, object())
    with pytest.raises(ValueError, match="unknown widget 'nope'") as info:
        reg.get("nope")
    assert isinstance(info.value, UnknownNameError)
    assert info.value.available == ["alpha", "mid", "zeta"]
    assert "alpha, mid, zeta" in str(info.value)
    assert reg.names() == ["alpha", "mid", "zeta"]


def test_empty_name_is_refused() -> None:
    reg: Registry[object] = Registry("widget")
    with pytest.raises(ValueError, match="non-empty string"):
        reg.register("", a)


def test_validator_converts_and_rejects() -> None:
    def validate(name: str, obj: object) -> int:
        if not isinstance(obj, int):
            raise TypeError(f"{name} must be an int")
        return obj * 10

    reg: Registry[int] = Registry("number", validate)
    assert reg.validate("n", 4) == 40
    with pytest.raises(TypeError, match="must be an int"):
        reg.validate("n", "x")


@pytest.fixture
def plugin_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "site"
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv("EXPORTLM_DISABLE_PLUGINS", raising=False)
    yield root
    for mod in [m for m in sys.modules if m.startswith("plug_")]:
        del sys.modules[mod]


def _group() -> str:
    return f"exportlm.test_{uuid.uuid4().hex[:8]}"


def _install(root: Path, group: str) -> None:
    root.mkdir(parents=True, exist_ok=True)
    make_distribution(
        root,
        "good-plugin",
        {group: {"zz_good": "plug_good:value", "aa_good": "plug_good:other"}},
        {"plug_good.py": "value = 'good'\nother = 'other'\n"},
    )
    make_distribution(
        root,
        "broken-plugin",
        {group: {"mm_broken": "plug_broken:value"}},
        {"plug_broken.py": "raise ImportError('missing dependency: frobnicate')\n"},
        version="0.3",
    )


def test_entry_points_load_sorted_and_idempotent(plugin_path: Path) -> None:
    group = _group()
    make_distribution(
        plugin_path,
        "good-plugin",
        {group: {"zz_good": "plug_good:value", "aa_good": "plug_good:other"}},
        {"plug_good.py": "value = 'good'\nother = 'other'\n"},
    )
    reg: Registry[str] = Registry("thing")
    assert load_entry_point_registry(group, reg) == ["aa_good", "zz_good"]
    assert reg.get("zz_good") == "good"
    entry = reg.entry("aa_good")
    assert entry.distribution == "good-plugin 1.0"
    assert entry.entry_point == "plug_good:other"
    assert load_entry_point_registry(group, reg) == []  # idempotent
    assert reg.names() == ["aa_good", "zz_good"]


def test_broken_plugin_is_wrapped_and_does_not_hide_others(plugin_path: Path) -> None:
    group = _group()
    _install(plugin_path, group)
    reg: Registry[str] = Registry("thing")
    with pytest.raises(PluginLoadError) as info:
        load_entry_point_registry(group, reg)
    err = info.value
    assert err.distribution == "broken-plugin 0.3"
    assert "mm_broken" in str(err)
    assert "missing dependency: frobnicate" in str(err)
    assert isinstance(err.__cause__, ImportError)
    # Raised only after every other plugin was loaded.
    assert reg.names() == ["aa_good", "zz_good"]
    # Looking the broken name up re-raises its load error instead of "unknown".
    with pytest.raises(PluginLoadError, match=r"broken-plugin 0\.3"):
        reg.get("mm_broken")
    assert list(reg.failed()) == ["mm_broken"]


def test_collect_mode_warns_instead_of_raising(plugin_path: Path) -> None:
    group = _group()
    _install(plugin_path, group)
    reg: Registry[str] = Registry("thing")
    with pytest.warns(PluginWarning, match="broken-plugin"):
        loaded = load_entry_point_registry(group, reg, raise_errors=False)
    assert loaded == ["aa_good", "zz_good"]
    assert len(reg.plugin_errors) == 1


def test_validation_failure_is_a_plugin_load_error(plugin_path: Path) -> None:
    group = _group()
    make_distribution(
        plugin_path, "bad-value", {group: {"x": "plug_bad:value"}}, {"plug_bad.py": "value = 3\n"}
    )

    def must_be_str(name: str, obj: object) -> str:
        if not isinstance(obj, str):
            raise TypeError(f"{name}: expected str, got {type(obj).__name__}")
        return obj

    reg: Registry[str] = Registry("thing", must_be_str)
    with pytest.raises(PluginLoadError, match="expected str, got int"):
        load_entry_point_registry(group, reg)


def test_entry_point_claiming_a_builtin_name_raises_naming_the_distribution(
    plugin_path: Path,
) -> None:
    group = _group()
    make_distribution(
        plugin_path,
        "squatter",
        {group: {"onnx": "plug_squat:value"}},
        {"plug_squat.py": "value = 'fake'\n"},
    )
    reg: Registry[str] = Registry("export target")
    reg.register("onnx", "real", builtin=True)
    with pytest.raises(RegistryConflictError) as info:
        load_entry_point_registry(group, reg)
    assert "squatter 1.0" in str(info.value)
    assert "exportlm (built in)" in str(info.value)
    assert reg.get("onnx") == "real"


def test_kill_switch_skips_discovery(plugin_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    group = _group()
    _install(plugin_path, group)
    monkeypatch.setenv("EXPORTLM_DISABLE_PLUGINS", "1")
    reg: Registry[str] = Registry("thing")
    assert load_entry_point_registry(group, reg) == []
    assert len(reg) == 0


def _run(code: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **env_extra}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=120,
    )


def test_onnx_resolves_without_any_plugin_machinery() -> None:
    code = (
        "from exportlm.export import EXPORT_REGISTRY, ensure_exporters_registered\n"
        "ensure_exporters_registered()\n"
        "print(EXPORT_REGISTRY.names())\n"
        "print(EXPORT_REGISTRY.entry('onnx').provider)\n"
    )
    proc = _run(code, {"EXPORTLM_DISABLE_PLUGINS": "1"})
    assert proc.returncode == 0, proc.stderr
    names, provider = proc.stdout.strip().splitlines()[-2:]
    assert "'onnx'" in names  # the kill switch keeps exportlm's own targets too
    assert provider == "exportlm (built in)"


def test_builtin_entry_point_targets_are_discovered_with_their_distribution() -> None:
    code = (
        "from exportlm.export import EXPORT_REGISTRY, RUNTIME_REGISTRY, ensure_exporters_registered\n"
        "ensure_exporters_registered()\n"
        "for n in ('torchscript', 'torch_export'):\n"
        "    print(n, EXPORT_REGISTRY.entry(n).provider, n in RUNTIME_REGISTRY)\n"
    )
    proc = _run(code, {"EXPORTLM_DISABLE_PLUGINS": "0"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("torchscript exportlm ")
    assert lines[0].endswith("True")
    assert lines[1].startswith("torch_export exportlm ")
    assert lines[1].endswith("True")


def test_once_runs_a_registration_function_once_and_retries_after_a_failure() -> None:
    from exportlm.registry import once

    calls: list[int] = []

    @once
    def register() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("first attempt fails")

    with pytest.raises(RuntimeError):
        register()
    register()
    register()
    assert len(calls) == 2
    assert register.__name__ == "register"  # functools.wraps: the docs and repr keep the name
    register.reset()  # forgotten: the next call runs it again, once
    register()
    register()
    assert len(calls) == 3


def test_installed_loads_a_distribution_for_one_run_and_puts_every_registry_back(
    plugin_path: Path,
) -> None:
    """tests/_installed.py, which lets plugin runs of the tests stay in this process: inside,
    the registries hold the built-ins and the entry points found on the path, as a fresh
    process would; outside, exactly what they held before."""
    from exportlm.export import EXPORT_REGISTRY, ensure_exporters_registered
    from exportlm.inventory import plugin_inventory
    from pytest_exportcheck.checks import CHECKS
    from pytest_exportcheck.checks.catalogue import BUILTIN_CHECKS
    from tests._installed import installed

    site = plugin_path.parent / "isolated-site"
    make_distribution(
        site,
        "isolated-plugin",
        {"exportlm.export_backends": {"isolated": "plug_isolated:export", "gone": "plug_x:y"}},
        {"plug_isolated.py": "def export(model, output_path):\n    return output_path\n"},
    )
    ensure_exporters_registered()
    before = plugin_inventory()
    checks = dict(CHECKS)
    environment = os.environ.get("PYTHONPATH")
    with installed(site):
        assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(site)  # for its children
        assert "isolated" not in EXPORT_REGISTRY  # not loaded until the first ensure
        with pytest.warns(PluginWarning, match="plug_x"):  # warned then, as a fresh process warns
            ensure_exporters_registered()
        assert EXPORT_REGISTRY.entry("isolated").provider == "isolated-plugin 1.0"
        assert set(EXPORT_REGISTRY.failed()) == {"gone"}
        assert all(e.builtin or e.name == "isolated" for e in EXPORT_REGISTRY.entries())
        assert list(CHECKS) == [spec.id for spec in BUILTIN_CHECKS]  # a fresh catalogue
    assert plugin_inventory() == before
    assert dict(CHECKS) == checks
    assert "isolated" not in EXPORT_REGISTRY
    assert str(site) not in sys.path
    assert os.environ.get("PYTHONPATH") == environment


def test_records_list_loaded_failed_and_conflicting_entry_points(plugin_path: Path) -> None:
    group = _group()
    make_distribution(
        plugin_path,
        "mixed-plugin",
        {
            group: {
                "good": "plug_mixed:value",
                "broken": "plug_mixed:missing",
                "taken": "plug_mixed:value",
            }
        },
        {"plug_mixed.py": "value = 'mine'\n"},
    )
    reg: Registry[str] = Registry("thing")
    reg.register("taken", "built in", builtin=True)
    with pytest.warns(PluginWarning):
        load_entry_point_registry(group, reg, raise_errors=False)
    by_name = {(r.name, r.status): r for r in reg.records()}
    assert set(by_name) == {
        ("good", "loaded"),
        ("taken", "loaded"),
        ("broken", "failed"),
        ("taken", "conflict"),
    }
    good = by_name["good", "loaded"]
    assert (good.group, good.value, good.provider) == (
        group,
        "plug_mixed:value",
        "mixed-plugin 1.0",
    )
    assert by_name["taken", "loaded"].provider == "exportlm (built in)"
    assert by_name["taken", "loaded"].group is None  # registered in code
    broken = by_name["broken", "failed"]
    assert isinstance(broken.error, PluginLoadError)
    assert broken.error.name == "broken"
    assert "plug_mixed:missing" in broken.message
    conflict = by_name["taken", "conflict"]
    assert isinstance(conflict.error, RegistryConflictError)
    assert "mixed-plugin 1.0" in conflict.message
    assert reg.get("taken") == "built in"  # the existing entry stays usable


def test_the_inventory_is_what_list_and_the_plugin_read() -> None:
    from exportlm.cli._inventory import collect_inventory
    from exportlm.inventory import plugin_inventory

    records = plugin_inventory()
    kinds = {r.kind for r in records}
    assert {"export target", "runtime", "module exporter", "model family"} <= kinds
    loaded = {(r.kind, r.name) for r in records if r.status == "loaded"}
    assert ("export target", "onnx") in loaded
    assert ("export target", "hf_checkpoint") in loaded
    listed = collect_inventory()
    assert {t["name"] for t in listed.targets} == {n for k, n in loaded if k == "export target"}
    problems = [r for r in records if r.status != "loaded"]
    assert len(listed.failed_plugins) == len(problems)
