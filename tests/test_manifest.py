"""The manifest beside every artifact: where it is, what it records, how it is verified."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch
from torch import nn

from exportlm.errors import ArtifactIntegrityError, ManifestSchemaError
from exportlm.export import EXPORT_REGISTRY, export_model, export_target
from exportlm.export.manifest import (
    MANIFEST_SCHEMA,
    NewerManifestWarning,
    manifest_path,
    model_hash,
    read_manifest,
    verify_artifact,
)
from exportlm.models import DecoderConfig, DecoderModel, tiny_hf_model


@pytest.fixture(autouse=True)
def _key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXPORTLM_KEY_FILE", str(tmp_path / "home" / "key"))


def _model(seed: int = 0) -> DecoderModel:
    torch.manual_seed(seed)
    return DecoderModel(DecoderConfig(hidden_size=32, intermediate_size=64, num_layers=1)).eval()


def _export(target: str, model: nn.Module, path: Path, **options: Any) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return export_model(target, model, path, **options)


def test_manifest_paths(tmp_path: Path) -> None:
    assert manifest_path(tmp_path / "m.onnx") == tmp_path / "m.onnx.manifest.json"
    (tmp_path / "ckpt").mkdir()
    assert manifest_path(tmp_path / "ckpt") == tmp_path / "ckpt" / "exportlm-manifest.json"


def test_the_manifest_records_what_the_artifact_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXPORTLM_MODEL_HASH", "1")  # the model hash is asked for
    model = _model()
    path = _export("torchscript", model, tmp_path / "m.pt", method="trace")
    manifest = verify_artifact(path)
    assert manifest.schema == MANIFEST_SCHEMA
    assert (manifest.target, manifest.variant) == ("torchscript", "trace")
    assert manifest.options["method"] == "trace"
    assert str(manifest.versions["torch"]).startswith(torch.__version__.split("+")[0])
    assert manifest.inputs == [
        {"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]}
    ]
    assert manifest.tolerance == {"atol": 1e-5, "rtol": 1e-5}
    assert manifest.vocab_size == 256
    assert manifest.model_hash == model_hash(model)
    digest = blake3.blake3(path.read_bytes()).hexdigest()
    assert manifest.files == {"m.pt": {"blake3": digest, "size": path.stat().st_size}}
    assert manifest.is_own()


def test_model_hash_is_exact_bytes_of_structure_and_weights() -> None:
    a, b = _model(0), _model(0)
    assert model_hash(a) == model_hash(b)
    with torch.no_grad():
        next(b.parameters()).view(-1)[0] += 1e-7  # one ulp-sized change is a different model
    assert model_hash(a) != model_hash(b)


def test_a_directory_artifact_carries_its_manifest_inside(tmp_path: Path) -> None:
    out = _export("hf_checkpoint", tiny_hf_model("llama", num_hidden_layers=1), tmp_path / "c")
    manifest = verify_artifact(out)
    assert set(manifest.files) == {p.name for p in out.iterdir()} - {"exportlm-manifest.json"}
    extra = out / "injected.py"
    extra.write_text("print('hi')")
    with pytest.raises(ArtifactIntegrityError, match=r"injected\.py") as excinfo:
        verify_artifact(out)
    assert excinfo.value.path == extra
    extra.unlink()
    (out / "config.json").unlink()
    with pytest.raises(ArtifactIntegrityError, match=r"config.json is listed .* but missing"):
        verify_artifact(out)


def test_schema_newer_warns_unknown_or_garbled_is_an_error(tmp_path: Path) -> None:
    path = _export("torchscript", _model(), tmp_path / "m.pt")
    data = json.loads(manifest_path(path).read_text())
    manifest_path(path).write_text(json.dumps({**data, "schema": MANIFEST_SCHEMA + 1}))
    with pytest.warns(NewerManifestWarning, match="newer"):
        assert read_manifest(path) is not None
    manifest_path(path).write_text(json.dumps({**data, "schema": "one"}))
    with pytest.raises(ManifestSchemaError, match="schema 'one'"):
        read_manifest(path)
    manifest_path(path).write_text('{"schema": 1, "target": "torchscr')
    with pytest.raises(ManifestSchemaError, match="not valid UTF-8 JSON"):
        read_manifest(path)


def test_a_third_party_target_without_atomic_output_gets_a_manifest(tmp_path: Path) -> None:
    @export_target("h8a_plain_writer", runtime="torchscript")
    def plain(model: nn.Module, output_path: Path) -> Path:
        output_path.write_bytes(b"not staged")
        return output_path

    EXPORT_REGISTRY.register("h8a_plain_writer", plain)
    try:
        path = export_model("h8a_plain_writer", _model(), tmp_path / "x.bin")
    finally:
        EXPORT_REGISTRY.unregister("h8a_plain_writer")
    manifest = verify_artifact(path)
    assert manifest.target == "h8a_plain_writer"
    assert list(manifest.files) == ["x.bin"]


def test_a_third_party_target_records_the_runtime_library_it_declares(tmp_path: Path) -> None:
    """The runtime library is a fact of the target's record: no table keyed by target name."""

    @export_target("h40_bytes", runtime="torchscript", runtime_library="blake3")
    def declared(model: nn.Module, output_path: Path) -> Path:
        output_path.write_bytes(b"bytes")
        return output_path

    @export_target("h40_silent", runtime="torchscript")
    def silent(model: nn.Module, output_path: Path) -> Path:
        output_path.write_bytes(b"bytes")
        return output_path

    for name, factory in (("h40_bytes", declared), ("h40_silent", silent)):
        EXPORT_REGISTRY.register(name, factory)
    try:
        stated = verify_artifact(export_model("h40_bytes", _model(), tmp_path / "a.bin"))
        unstated = verify_artifact(export_model("h40_silent", _model(), tmp_path / "b.bin"))
    finally:
        for name in ("h40_bytes", "h40_silent"):
            EXPORT_REGISTRY.unregister(name)
    assert stated.versions["runtime:blake3"] == blake3.__version__
    assert set(stated.versions) == {"exportlm", "torch", "transformers", "runtime:blake3"}
    assert set(unstated.versions) == {"exportlm", "torch", "transformers"}


@pytest.mark.parametrize(
    ("target", "library"),
    [("onnx", "onnxruntime"), ("torchscript", "torch"), ("hf_checkpoint", "safetensors")],
)
def test_a_built_in_target_records_its_runtime_library(
    tmp_path: Path, target: str, library: str
) -> None:
    model = tiny_hf_model("llama", num_hidden_layers=1) if target == "hf_checkpoint" else _model()
    options = {"method": "trace"} if target == "torchscript" else {}
    manifest = verify_artifact(_export(target, model, tmp_path / f"m-{target}", **options))
    assert manifest.versions[f"runtime:{library}"] is not None


def test_the_manifest_names_the_one_artifact_it_vouches_for(tmp_path: Path) -> None:
    path = _export("torchscript", _model(), tmp_path / "m.pt")
    manifest = verify_artifact(path)
    assert (manifest.artifact_name, manifest.artifact_kind) == ("m.pt", "file")
    assert json.loads(manifest_path(path).read_text())["artifact"] == {
        "name": "m.pt",
        "kind": "file",
    }
    out = _export("hf_checkpoint", tiny_hf_model("llama", num_hidden_layers=1), tmp_path / "ckpt")
    manifest = verify_artifact(out)
    assert (manifest.artifact_name, manifest.artifact_kind) == ("ckpt", "directory")  # not staging


def test_a_manifest_copied_into_another_directory_artifact_fails(tmp_path: Path) -> None:
    a = _export("hf_checkpoint", tiny_hf_model("llama", num_hidden_layers=1), tmp_path / "a")
    b = _export(
        "hf_checkpoint", tiny_hf_model("llama", num_hidden_layers=1, seed=1), tmp_path / "b"
    )
    (b / "exportlm-manifest.json").write_bytes((a / "exportlm-manifest.json").read_bytes())
    with pytest.raises(ArtifactIntegrityError, match="does not match its blake3 digest"):
        verify_artifact(b)


def test_a_file_manifest_beside_a_directory_proves_nothing(tmp_path: Path) -> None:
    pt = _export("torchscript", _model(), tmp_path / "m.pt")
    out = _export("hf_checkpoint", tiny_hf_model("llama", num_hidden_layers=1), tmp_path / "c")
    (out / "exportlm-manifest.json").write_bytes(manifest_path(pt).read_bytes())
    with pytest.raises(ArtifactIntegrityError, match="written for a file artifact"):
        verify_artifact(out)


def test_a_manifest_that_is_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    import os

    from exportlm.errors import NotRegularFileError

    path = _export("torchscript", _model(), tmp_path / "m.pt")
    manifest_path(path).unlink()
    os.mkfifo(manifest_path(path))
    with pytest.raises(NotRegularFileError, match="FIFO"):
        read_manifest(path)
