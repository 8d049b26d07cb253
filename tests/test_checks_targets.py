"""Target checks called directly (no plugin): real targets pass, deliberately broken ones fail.

The broken targets are small ``torch.jit.trace`` exporters registered for one
test in the real registries, each wrong in one way; the check that names that
fault must fail with a message that says what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from exportlm.errors import RegistryConflictError
from exportlm.export import (
    EXPORT_REGISTRY,
    RUNTIME_REGISTRY,
    ExportCacheWrapper,
    atomic_output,
    ensure_exporters_registered,
    export_model,
    export_target,
    resolve_example_inputs,
)
from exportlm.registry import PluginRecord
from pytest_exportcheck.checks import CHECKS, CheckResult, TargetCase
from pytest_exportcheck.checks.targets import SENTINEL_BYTES

FAKE = "exportcheck_fake"


def run(check_id: str, case: TargetCase) -> CheckResult:
    return CHECKS[check_id].fn(case)


def make_case(
    tmp_path: Path, target: str, model: str | None = "decoder", **kwargs: Any
) -> TargetCase:
    workdir = tmp_path / "work"
    workdir.mkdir(exist_ok=True)
    return TargetCase(target, None, kwargs, model, "cpu", workdir)


def cached_export(case: TargetCase, directory: Path) -> Callable[..., Path]:
    """What the plugin provides: an export per model name, done once."""
    cache: dict[str, Path] = {}

    def export(model_name: str, **extra: Any) -> Path:
        if model_name not in cache:
            from exportlm.models import build_model

            suffix = ".onnx" if case.target == "onnx" else ".pt"
            out = directory / model_name / f"model{suffix}"
            cache[model_name] = export_model(
                case.target, build_model(model_name), out, **case.export_kwargs, **extra
            )
        return cache[model_name]

    return export


# ----------------------------------------------------------------------------- fake targets


def _trace(
    model: torch.nn.Module, example_inputs: Any, wrap: bool = True
) -> torch.jit.ScriptModule:
    inputs = resolve_example_inputs(model, example_inputs)
    module = ExportCacheWrapper(model) if wrap else model
    with torch.no_grad():
        return torch.jit.trace(module, inputs[:1], strict=False, check_trace=False)


def good_export(model: torch.nn.Module, output_path: Path, *, example_inputs: Any = None) -> Path:
    with atomic_output(output_path) as staged:
        torch.jit.save(_trace(model, example_inputs), str(staged))
    return Path(output_path)


def jit_loader(artifact: Path, *, device: str = "cpu") -> Callable[[torch.Tensor], Any]:
    module = torch.jit.load(str(artifact), map_location=device)

    def run_module(ids: torch.Tensor) -> Any:
        with torch.no_grad():
            return module(ids)

    return run_module


def perturbing_loader(artifact: Path, *, device: str = "cpu") -> Callable[[torch.Tensor], Any]:
    inner = jit_loader(artifact, device=device)
    return lambda ids: inner(ids) + 1e-2


def nan_loader(artifact: Path, *, device: str = "cpu") -> Callable[[torch.Tensor], Any]:
    inner = jit_loader(artifact, device=device)

    def run_nan(ids: torch.Tensor) -> torch.Tensor:
        out = inner(ids).clone()
        out[0, 0, 0] = float("nan")
        return out

    return run_nan


#: The ``(batch, seq)`` the broken runtimes below are "compiled" for: the checks' traced shape.
FIXED_SHAPE = (2, 8)


def fixed_shape_loader(artifact: Path, *, device: str = "cpu") -> Callable[[torch.Tensor], Any]:
    """Runs every input as the fixed [2, 8] batch (zero-padded or cropped), as an artifact
    with a baked-in input shape does: right at [2, 8], the wrong shape anywhere else."""
    inner = jit_loader(artifact, device=device)

    def run_fixed(ids: torch.Tensor) -> Any:
        fixed = torch.zeros(FIXED_SHAPE, dtype=ids.dtype)
        batch, seq = min(ids.shape[0], FIXED_SHAPE[0]), min(ids.shape[1], FIXED_SHAPE[1])
        fixed[:batch, :seq] = ids[:batch, :seq]
        return inner(fixed)

    return run_fixed


def left_padding_loader(artifact: Path, *, device: str = "cpu") -> Callable[[torch.Tensor], Any]:
    """Left-pads shorter sequences to 8 tokens and returns the last ``seq`` positions: the
    right shape, but the padding shifts positions and is attended to (no mask)."""
    inner = jit_loader(artifact, device=device)

    def run_padded(ids: torch.Tensor) -> Any:
        seq = ids.shape[1]
        if seq < FIXED_SHAPE[1]:
            pad = torch.zeros(ids.shape[0], FIXED_SHAPE[1] - seq, dtype=ids.dtype)
            ids = torch.cat([pad, ids], dim=1)
        return inner(ids)[:, -seq:]

    return run_padded


def in_place_export(
    model: torch.nn.Module, output_path: Path, *, example_inputs: Any = None
) -> Path:
    """Writes the artifact directly at its final path: a failure leaves a half-written file."""
    with open(output_path, "wb") as handle:
        handle.write(b"PK\x03\x04 half-written")
        torch.jit.save(_trace(model, example_inputs), handle)
    return Path(output_path)


def swallowing_export(model: torch.nn.Module, output_path: Path, **kwargs: Any) -> Path:
    """Takes **kwargs and silently ignores the ones it does not know."""
    return good_export(model, output_path, example_inputs=kwargs.get("example_inputs"))


def unwrapped_export(
    model: torch.nn.Module, output_path: Path, *, example_inputs: Any = None
) -> Path:
    """Traces the model itself, so a (logits, cache) forward stays a tuple in the artifact."""
    with atomic_output(output_path) as staged:
        torch.jit.save(_trace(model, example_inputs, wrap=False), str(staged))
    return Path(output_path)


def littering_export(
    model: torch.nn.Module, output_path: Path, *, example_inputs: Any = None
) -> Path:
    good_export(model, output_path, example_inputs=example_inputs)
    (Path(output_path).parent / "export.log").write_text("done\n")
    return Path(output_path)


def salted_export(model: torch.nn.Module, output_path: Path, *, example_inputs: Any = None) -> Path:
    """Each export stores a different random offset the runtime adds: not deterministic."""
    with atomic_output(output_path) as staged:
        salt = json.dumps(random.random())
        torch.jit.save(_trace(model, example_inputs), str(staged), _extra_files={"salt": salt})
    return Path(output_path)


def salted_loader(artifact: Path, *, device: str = "cpu") -> Callable[[torch.Tensor], Any]:
    files = {"salt": ""}
    module = torch.jit.load(str(artifact), map_location=device, _extra_files=files)
    salt = json.loads(files["salt"])
    return lambda ids: module(ids) + salt


@pytest.fixture
def fake_target() -> Iterator[Callable[..., str]]:
    """Register a fake target (and its runtime) under one name for one test, then remove it."""
    ensure_exporters_registered()
    registered: list[str] = []

    def register(
        factory: Callable[..., Path],
        loader: Callable[..., Any] = jit_loader,
        **info: Any,
    ) -> str:
        declared = export_target(FAKE, suffix=".pt", **info)(factory)
        EXPORT_REGISTRY.register(FAKE, declared)
        registered.append("export")
        RUNTIME_REGISTRY.register(FAKE, loader)
        registered.append("runtime")
        return FAKE

    yield register
    if "export" in registered:
        EXPORT_REGISTRY.unregister(FAKE)
    if "runtime" in registered:
        RUNTIME_REGISTRY.unregister(FAKE)


# ----------------------------------------------------------------------------- a good target passes


@pytest.mark.parametrize(
    "check_id",
    [
        "plugin_loads",
        "registered",
        "artifact_contract",
        "roundtrip_logits",
        "dynamic_shapes",
        "cache_wrapper",
        "deterministic",
        "atomic_failure",
        "unknown_kwargs",
    ],
)
def test_a_correct_target_passes_every_check(
    tmp_path: Path, fake_target: Callable[..., str], check_id: str
) -> None:
    target = fake_target(good_export, capabilities={"dynamic_shapes"})
    result = run(check_id, make_case(tmp_path, target))
    assert result.status == "pass", result.message


def test_onnx_roundtrip_and_failure_checks_pass(tmp_path: Path) -> None:
    case = make_case(tmp_path, "onnx")
    case.export = cached_export(case, tmp_path / "cache")
    for check_id in ("registered", "roundtrip_logits", "unknown_kwargs"):
        result = run(check_id, case)
        assert result.status == "pass", f"{check_id}: {result.message}"
    assert "max abs" in run("roundtrip_logits", case).message


def test_a_target_refusing_the_model_is_a_counted_skip(
    tmp_path: Path, fake_target: Callable[..., str]
) -> None:
    target = fake_target(good_export, accepts=lambda model: "only takes llamas")
    result = run("roundtrip_logits", make_case(tmp_path, target, "decoder"))
    assert result.status == "skip"
    assert "only takes llamas" in result.message


def test_capability_gap_is_a_skip_with_the_reason(
    tmp_path: Path, fake_target: Callable[..., str]
) -> None:
    target = fake_target(good_export)  # no dynamic_shapes declared
    result = run("dynamic_shapes", make_case(tmp_path, target))
    assert result.status == "skip"
    assert "dynamic_shapes" in result.message


# ----------------------------------------------------------------------------- broken targets fail


def test_perturbed_logits_fail_roundtrip_with_the_numbers(
    tmp_path: Path, fake_target: Callable[..., str]
) -> None:
    target = fake_target(good_export, perturbing_loader, atol=1e-4, rtol=1e-4)
    result = run("roundtrip_logits", make_case(tmp_path, target))
    assert result.status == "fail"
    assert "max abs 0.01" in result.message
    assert "max rel" in result.message
    assert "100% of 4096 elements" in result.message
    assert result.details["max_abs"] == pytest.approx(1e-2, rel=1e-3)


@pytest.mark.parametrize(
    ("loader", "expected"),
    [
        (fixed_shape_loader, "shape [2, 8, 256] does not match the expected [1, 5, 256]"),
        (left_padding_loader, "logits differ from the eager model at input_ids [1, 5]: max abs"),
    ],
)
def test_a_runtime_bound_to_the_traced_shape_fails_dynamic_shapes(
    tmp_path: Path, fake_target: Callable[..., str], loader: Callable[..., Any], expected: str
) -> None:
    """The target declares dynamic_shapes, but its runtime is only right at [2, 8]."""
    target = fake_target(good_export, loader, capabilities={"dynamic_shapes"})
    case = make_case(tmp_path, target)
    traced = run("roundtrip_logits", case)
    assert traced.status == "pass", traced.message  # the fault shows only at other shapes
    result = run("dynamic_shapes", case)
    assert result.status == "fail", result.message
    assert expected in result.message


def test_nan_in_the_runtime_output_fails_roundtrip(
    tmp_path: Path, fake_target: Callable[..., str]
) -> None:
    target = fake_target(good_export, nan_loader, atol=1.0, rtol=1.0)
    result = run("roundtrip_logits", make_case(tmp_path, target))
    assert result.status == "fail"
    assert "1 NaN/inf" in result.message


def test_in_place_writer_fails_atomic_failure(
    tmp_path: Path, fake_target: Callable[..., str]
) -> None:
    target = fake_target(in_place_export)
    result = run("atomic_failure", make_case(tmp_path, target, model=None))
    assert result.status == "fail"
    assert "left ['model.pt']" in result.message


def test_swallowed_kwargs_fail_unknown_kwargs(
    tmp_path: Path, fake_target: Callable[..., str]
) -> None:
    target = fake_target(swallowing_export)
    result = run("unknown_kwargs", make_case(tmp_path, target, model=None))
    assert result.status == "fail"
    assert "export accepted the unknown option 'example_input'" in result.message


def test_tuple_output_fails_cache_wrapper(tmp_path: Path, fake_target: Callable[..., str]) -> None:
    target = fake_target(unwrapped_export)
    result = run("cache_wrapper", make_case(tmp_path, target, model=None))
    assert result.status == "fail"
    assert "returned a tuple of 2 items" in result.message


def test_files_next_to_the_artifact_fail_artifact_contract(
    tmp_path: Path, fake_target: Callable[..., str]
) -> None:
    target = fake_target(littering_export)
    result = run("artifact_contract", make_case(tmp_path, target, model=None))
    assert result.status == "fail"
    assert "['export.log']" in result.message


def test_files_next_to_a_cached_artifact_fail_artifact_contract(
    tmp_path: Path, fake_target: Callable[..., str]
) -> None:
    """With the plugin's shared export, the export's own directory is inspected."""
    target = fake_target(littering_export)
    case = make_case(tmp_path, target, model=None)
    case.export = cached_export(case, tmp_path / "cache")
    result = run("artifact_contract", case)
    assert result.status == "fail"
    assert "['export.log']" in result.message


def test_a_path_outside_the_output_directory_fails_artifact_contract_through_the_cache(
    tmp_path: Path, fake_target: Callable[..., str]
) -> None:
    """The plugin's cache refuses an artifact returned outside its export directory."""
    from exportlm.models import build_model as build_toy_model
    from pytest_exportcheck.checks._registries import Registries
    from pytest_exportcheck.run._cache import ArtifactCache

    def elsewhere(model: torch.nn.Module, output_path: Path, *, example_inputs: Any = None) -> Path:
        target = Path(output_path).parent.parent / "elsewhere.pt"
        return good_export(model, target, example_inputs=example_inputs)

    target = fake_target(elsewhere)
    cache = ArtifactCache(
        tmp_path / "session", tmp_path / "root", build_toy_model, Registries.installed()
    )
    case = make_case(tmp_path, target, model=None)
    case.export = lambda model, **extra: cache.export(target, extra, model, suffix=".pt")
    result = run("artifact_contract", case)
    assert result.status == "fail"
    assert "not a path in the output directory" in result.message


def test_companion_files_are_allowed_for_multi_file_targets(
    tmp_path: Path, fake_target: Callable[..., str]
) -> None:
    def with_data(model: torch.nn.Module, output_path: Path, *, example_inputs: Any = None) -> Path:
        with atomic_output(output_path) as staged:
            torch.jit.save(_trace(model, example_inputs), str(staged))
            staged.with_name(staged.name + ".data").write_bytes(b"weights")
        return Path(output_path)

    target = fake_target(with_data, capabilities={"multi_file"})
    result = run("artifact_contract", make_case(tmp_path, target, model=None))
    assert result.status == "pass", result.message
    assert result.details["companions"] == ["model.pt.data"]


def test_salted_exports_fail_deterministic(tmp_path: Path, fake_target: Callable[..., str]) -> None:
    target = fake_target(salted_export, salted_loader)
    result = run("deterministic", make_case(tmp_path, target, model=None))
    assert result.status == "fail"
    assert "different outputs" in result.message


def test_salted_export_differs_from_its_cached_artifact(
    tmp_path: Path, fake_target: Callable[..., str]
) -> None:
    """A cached artifact (from this run or an earlier one) against a fresh export still fails."""
    target = fake_target(salted_export, salted_loader)
    case = make_case(tmp_path, target, model=None)
    case.export = cached_export(case, tmp_path / "cache")
    case.export("decoder")  # e.g. cached by an earlier run
    result = run("deterministic", case)
    assert result.status == "fail"
    assert "different outputs" in result.message


def test_unregistered_runtime_fails_registered(
    tmp_path: Path, fake_target: Callable[..., str]
) -> None:
    target = fake_target(good_export, runtime="nowhere")
    result = run("registered", make_case(tmp_path, target, model=None))
    assert result.status == "fail"
    assert "runtime 'nowhere' is not registered" in result.message


def test_variant_with_refused_options_fails_registered(
    tmp_path: Path, fake_target: Callable[..., str]
) -> None:
    target = fake_target(good_export, variants={"fast": {"fast": True}})
    result = run("registered", make_case(tmp_path, target, model=None))
    assert result.status == "fail"
    assert "variant 'fast'" in result.message


def test_conflicting_entry_point_fails_plugin_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ensure_exporters_registered()
    conflict = RegistryConflictError(
        "export target", "onnx", "exportlm (built in)", "evil-plugin 1.0"
    )
    record = PluginRecord(
        "export target",
        "onnx",
        "conflict",
        "evil-plugin 1.0",
        "exportlm.export_backends",
        "evil:build",
        conflict,
    )
    recorded = EXPORT_REGISTRY.records
    monkeypatch.setattr(EXPORT_REGISTRY, "records", lambda: [*recorded(), record])
    result = run("plugin_loads", make_case(tmp_path, "onnx", model=None))
    assert result.status == "fail"
    assert "evil-plugin 1.0" in result.message


def test_sentinel_survives_a_correct_target(
    tmp_path: Path, fake_target: Callable[..., str]
) -> None:
    target = fake_target(good_export)
    case = make_case(tmp_path, target, model=None)
    assert run("atomic_failure", case).status == "pass"
    assert (case.workdir / "atomic_existing" / "model.pt").read_bytes() == SENTINEL_BYTES
    assert list((case.workdir / "atomic_fresh").iterdir()) == []


def test_every_check_is_documented_with_its_scope() -> None:
    docs = (Path(__file__).resolve().parents[1] / "docs" / "checks.md").read_text()
    target_section, exporter_section = docs.split("## Module-exporter checks")
    for spec in CHECKS.values():
        assert spec.doc, f"{spec.id} has no docstring"
        section = target_section if spec.scope == "target" else exporter_section
        assert f"| `{spec.id}` |" in section, f"{spec.id} is not in the {spec.scope} table"


# ----------------------------------------------------------------------------- the exception behind a failure


class FactoryBug(RuntimeError):
    """Raised by the fake factory and runtime below: a bug in the code under test."""


def raising_export(
    model: torch.nn.Module, output_path: Path, *, example_inputs: Any = None
) -> Path:
    raise FactoryBug("the factory cannot export this model")


def raising_runtime_loader(artifact: Path, *, device: str = "cpu") -> Callable[[torch.Tensor], Any]:
    def raising_runtime(ids: torch.Tensor) -> Any:
        raise FactoryBug("the runtime cannot run these ids")

    return raising_runtime


def _frames(err: BaseException) -> list[str]:
    names = []
    tb = err.__traceback__
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return names


@pytest.mark.parametrize(
    ("factory", "loader", "frame"),
    [
        (raising_export, jit_loader, "raising_export"),
        (good_export, raising_runtime_loader, "raising_runtime"),
    ],
)
def test_a_failure_raised_by_the_target_carries_its_exception(
    tmp_path: Path,
    fake_target: Callable[..., str],
    factory: Callable[..., Path],
    loader: Callable[..., Any],
    frame: str,
) -> None:
    """So that ``--pdb`` can land in the frame of the target's author."""
    target = fake_target(factory, loader)
    result = run("roundtrip_logits", make_case(tmp_path, target))
    assert result.status == "fail"
    assert isinstance(result.exception, FactoryBug)
    assert frame in _frames(result.exception)
    assert str(result.exception) in result.message
    assert result.details["error"] == "FactoryBug"


def test_a_failure_without_an_exception_carries_none(
    tmp_path: Path, fake_target: Callable[..., str]
) -> None:
    target = fake_target(good_export, perturbing_loader, atol=1e-4, rtol=1e-4)
    result = run("roundtrip_logits", make_case(tmp_path, target))
    assert result.status == "fail"
    assert result.exception is None


# ----------------------------------------------------------------------------- multi-file publishing


def _weights_bytes(model: torch.nn.Module) -> bytes:
    return b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())


def mixing_multi_file_export(
    model: torch.nn.Module, output_path: Path, *, example_inputs: Any = None
) -> Path:
    """Stages graph and data, then renames the data over the old data and the graph over the
    old graph: a failure in between leaves the old graph beside the new weights."""
    output = Path(output_path)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".stage-", dir=output.parent))
    try:
        torch.jit.save(_trace(model, example_inputs), str(staging / output.name))
        (staging / "data").write_bytes(_weights_bytes(model))
        os.replace(staging / "data", output.with_name(output.name + ".data"))
        os.replace(staging / output.name, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output


def unique_data_export(
    model: torch.nn.Module, output_path: Path, *, example_inputs: Any = None
) -> Path:
    """Names its data file by content and publishes the artifact last (atomic_output)."""
    weights = _weights_bytes(model)
    with atomic_output(output_path) as staged:
        torch.jit.save(_trace(model, example_inputs), str(staged))
        digest = hashlib.sha256(weights).hexdigest()[:16]
        staged.with_name(f"{staged.name}.{digest}.data").write_bytes(weights)
    return Path(output_path)


def test_a_multi_file_writer_that_mixes_old_and_new_fails_atomic_failure(
    tmp_path: Path, fake_target: Callable[..., str]
) -> None:
    target = fake_target(mixing_multi_file_export, capabilities={"multi_file"})
    result = run("atomic_failure", make_case(tmp_path, target, model=None))
    assert result.status == "fail", result.message
    assert "left a mixed artifact" in result.message
    assert "files of the old artifact were changed or removed: ['model.pt.data']" in (
        result.message
    )


def test_a_multi_file_target_publishing_its_artifact_last_passes_atomic_failure(
    tmp_path: Path, fake_target: Callable[..., str]
) -> None:
    target = fake_target(unique_data_export, capabilities={"multi_file"})
    result = run("atomic_failure", make_case(tmp_path, target, model=None))
    assert result.status == "pass", result.message
    assert "existing: rename 2 of 2 failed, old artifact kept" in result.message


# ----------------------------------------------------------------------------- trust


def pickle_export(model: torch.nn.Module, output_path: Path, *, example_inputs: Any = None) -> Path:
    """Pickles the whole module (its class is imported and rebuilt when loaded)."""
    with atomic_output(output_path) as staged:
        torch.save(ExportCacheWrapper(model), str(staged))
    return Path(output_path)


def pickle_loader(artifact: Path, *, device: str = "cpu") -> Callable[[torch.Tensor], Any]:
    module = torch.load(str(artifact), map_location=device, weights_only=False)
    return lambda ids: module(ids)


def test_an_undeclared_torchscript_target_fails_trust(
    tmp_path: Path, fake_target: Callable[..., str]
) -> None:
    target = fake_target(good_export)
    result = run("trust", make_case(tmp_path, target, model=None))
    assert result.status == "fail", result.message
    assert "a TorchScript archive" in result.message
    assert "declare executes_code=True" in result.message


def test_an_undeclared_pickle_target_fails_trust(
    tmp_path: Path, fake_target: Callable[..., str]
) -> None:
    target = fake_target(pickle_export, pickle_loader)
    result = run("trust", make_case(tmp_path, target, model=None))
    assert result.status == "fail", result.message
    assert "a pickle that imports and calls" in result.message
    assert "exportlm.export._wrapper.ExportCacheWrapper" in result.message


@pytest.mark.parametrize("factory", [good_export, pickle_export])
def test_a_declared_code_executing_target_passes_trust(
    tmp_path: Path, fake_target: Callable[..., str], factory: Callable[..., Path]
) -> None:
    loader = pickle_loader if factory is pickle_export else jit_loader
    target = fake_target(factory, loader, executes_code=True)
    result = run("trust", make_case(tmp_path, target, model=None))
    assert result.status == "pass", result.message
    assert "refuses a copy signed by nobody" in result.message


@pytest.mark.parametrize("target", ["onnx", "hf_checkpoint", "torchscript", "torch_export"])
def test_builtin_targets_pass_trust(tmp_path: Path, target: str) -> None:
    result = run("trust", make_case(tmp_path, target, model=None))
    assert result.status == "pass", result.message
