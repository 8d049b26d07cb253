"""The trust boundary: formats that can execute code load only when proven ours or trusted.

Also the refusals at the door (meta-device models, empty and out-of-vocabulary ids,
dtype names, special output files), each asserting the message names the problem and
the fix.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from exportlm.errors import (
    ArtifactIntegrityError,
    InvalidInputError,
    InvalidModelError,
    ManifestSchemaError,
    UnsupportedDtypeError,
    UnsupportedOutputPathError,
    UntrustedArtifactError,
)
from exportlm.export import export_model, get_target_info, load_exported, trustkey
from exportlm.export.guard import UnverifiedArtifactWarning
from exportlm.export.manifest import manifest_path
from exportlm.export.options import resolve_dtype
from exportlm.models import DecoderConfig, DecoderModel
from tests._payload import Payload, export_quietly, small_model

_IDS = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])


def _canonical(data: dict[str, object]) -> bytes:
    """The bytes a manifest's HMAC covers (everything but the HMAC), as exportlm signs them."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


@pytest.fixture(autouse=True)
def key_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "home" / "key"
    monkeypatch.setenv("EXPORTLM_KEY_FILE", str(path))
    return path


def test_built_in_targets_declare_whether_loading_executes_code() -> None:
    assert get_target_info("torchscript").executes_code
    assert get_target_info("torch_export").executes_code
    assert not get_target_info("onnx").executes_code
    assert not get_target_info("hf_checkpoint").executes_code


@pytest.mark.parametrize(("target", "suffix"), [("torch_export", ".pt2"), ("torchscript", ".pt")])
def test_a_poisoned_file_is_refused_before_anything_runs(
    target: str, suffix: str, tmp_path: Path
) -> None:
    marker = tmp_path / "marker"
    poisoned = tmp_path / f"received{suffix}"
    torch.save({"weights": Payload(marker)}, poisoned)
    with pytest.raises(UntrustedArtifactError) as excinfo:
        load_exported(target, poisoned)
    message = str(excinfo.value)
    assert str(poisoned) in message
    assert "execute arbitrary code" in message
    assert "trust=True" in message
    assert "--trust" in message
    assert not marker.exists()
    torch.load(poisoned, weights_only=False)  # the payload is live: it would have run
    assert marker.read_text() == "pwned"


@pytest.mark.parametrize("target", ["torchscript", "torch_export"])
def test_our_own_export_loads_without_trust(target: str, tmp_path: Path, key_file: Path) -> None:
    path = export_quietly(target, tmp_path / "m.bin")
    assert load_exported(target, path)(_IDS).shape == (2, 4, 256)
    if os.name == "posix":
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600


def test_an_artifact_signed_with_another_key_needs_trust(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = export_quietly("torchscript", tmp_path / "m.pt")
    monkeypatch.setenv("EXPORTLM_KEY_FILE", str(tmp_path / "other-machine" / "key"))
    with pytest.raises(UntrustedArtifactError, match="not signed by this machine"):
        load_exported("torchscript", path)
    assert load_exported("torchscript", path, trust=True)(_IDS).shape == (2, 4, 256)


def test_a_copied_manifest_does_not_vouch_for_other_bytes(tmp_path: Path) -> None:
    path = export_quietly("torchscript", tmp_path / "m.pt")
    foreign = tmp_path / "foreign.pt"
    shutil.copy(path, foreign)
    data = json.loads(manifest_path(path).read_text())
    data["files"] = {"foreign.pt": data["files"]["m.pt"]}  # edited: the signature breaks
    data["artifact"]["name"] = "foreign.pt"
    manifest_path(foreign).write_text(json.dumps(data))
    with pytest.raises(UntrustedArtifactError, match="not signed by this machine"):
        load_exported("torchscript", foreign)
    del data["artifact"]["name"]  # a schema-2 manifest must name its artifact
    manifest_path(foreign).write_text(json.dumps(data))
    with pytest.raises(ManifestSchemaError, match="no valid 'artifact' field"):
        load_exported("torchscript", foreign, trust=True)


def _sha256_entries(root: Path, files: dict[str, Any]) -> dict[str, Any]:
    """The file entries as schemas 1 and 2 wrote them: ``{"sha256", "size"}``."""
    return {
        name: {"sha256": hashlib.sha256((root / name).read_bytes()).hexdigest(), "size": e["size"]}
        for name, e in files.items()
    }


def test_an_old_manifest_without_the_artifact_name_cannot_vouch(tmp_path: Path) -> None:
    """Schema 1 did not require the artifact's name: such a manifest needs trust=True."""
    path = export_quietly("torchscript", tmp_path / "m.pt")
    data = json.loads(manifest_path(path).read_text())
    data = {k: v for k, v in data.items() if k not in ("artifact", "hmac")}
    data["schema"] = 1
    data["files"] = _sha256_entries(path.parent, data["files"])  # schema 1 listed sha256
    data["hmac"] = trustkey.sign(_canonical(data))  # signed here, yet names no artifact
    manifest_path(path).write_text(json.dumps(data))
    with pytest.raises(UntrustedArtifactError, match="does not name the artifact") as excinfo:
        load_exported("torchscript", path)
    assert "re-export" in str(excinfo.value)
    assert load_exported("torchscript", path, trust=True)(_IDS).shape == (2, 4, 256)


def test_a_schema_1_manifest_that_names_its_file_still_vouches(tmp_path: Path) -> None:
    path = export_quietly("torchscript", tmp_path / "m.pt")
    data = json.loads(manifest_path(path).read_text())
    data = {k: v for k, v in data.items() if k != "hmac"} | {"schema": 1}
    data["files"] = _sha256_entries(path.parent, data["files"])  # schema 1 listed sha256
    data["hmac"] = trustkey.sign(_canonical(data))
    manifest_path(path).write_text(json.dumps(data))
    assert load_exported("torchscript", path)(_IDS).shape == (2, 4, 256)


def test_a_tampered_file_is_refused_even_with_trust(tmp_path: Path) -> None:
    path = export_quietly("torch_export", tmp_path / "m.pt2")
    with open(path, "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(ArtifactIntegrityError) as excinfo:
        load_exported("torch_export", path, trust=True)
    assert str(path) in str(excinfo.value)
    assert "re-export" in str(excinfo.value)


def test_no_manifest_code_format_refused_data_format_warns(tmp_path: Path) -> None:
    pt = export_quietly("torchscript", tmp_path / "m.pt")
    manifest_path(pt).unlink()
    with pytest.raises(UntrustedArtifactError, match="no manifest"):
        load_exported("torchscript", pt)
    with pytest.warns(UnverifiedArtifactWarning):
        assert load_exported("torchscript", pt, trust=True)(_IDS).shape == (2, 4, 256)


def test_meta_device_model_is_refused_before_writing(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = DecoderModel(DecoderConfig(hidden_size=32, intermediate_size=64, num_layers=1))
    with pytest.raises(InvalidModelError, match="meta") as excinfo:
        export_model("torch_export", model, tmp_path / "m.pt2")
    assert "Load real weights first" in str(excinfo.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("ids", "problem", "fix"),
    [
        (torch.zeros(1, 0, dtype=torch.long), "hold no tokens", "at least one token"),
        (torch.tensor([[1, 256]]), "outside the vocabulary [0, 256)", "tokenizer"),
        (torch.tensor([[-1, 2]]), "token id -1", "clip/mask"),
    ],
)
def test_runtime_refuses_empty_and_out_of_vocabulary_ids(
    ids: torch.Tensor, problem: str, fix: str, tmp_path: Path
) -> None:
    runtime = load_exported("torchscript", export_quietly("torchscript", tmp_path / "m.pt"))
    with pytest.raises(InvalidInputError) as excinfo:
        runtime(ids)
    assert problem in str(excinfo.value)
    assert fix in str(excinfo.value)


@pytest.mark.parametrize("with_manifest", [True, False], ids=["manifest", "config-json"])
@pytest.mark.parametrize(
    ("ids", "problem", "fix"),
    [
        (torch.zeros(2, 0, dtype=torch.long), "hold no tokens", "at least one token"),
        (torch.tensor([[1, 256]]), "token id 256 is outside the vocabulary [0, 256)", "tokenizer"),
        (torch.tensor([[-3, 2]]), "token id -3", "clip/mask"),
    ],
)
def test_hf_checkpoint_runtime_refuses_empty_and_out_of_vocabulary_ids(
    ids: torch.Tensor, problem: str, fix: str, with_manifest: bool, tmp_path: Path
) -> None:
    from exportlm.models import build_model

    model = build_model("llama")
    assert model.config.vocab_size == 256
    checkpoint = export_model("hf_checkpoint", model, tmp_path / "ckpt")
    if not with_manifest:  # the vocabulary then comes from config.json alone
        manifest_path(checkpoint).unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnverifiedArtifactWarning)
        runtime = load_exported("hf_checkpoint", checkpoint)
    assert runtime(torch.tensor([[0, 255]])).shape == (1, 2, 256)  # the edges are in
    with pytest.raises(InvalidInputError) as excinfo:
        runtime(ids)
    assert str(excinfo.value).startswith("hf_checkpoint runtime: ")
    assert problem in str(excinfo.value)
    assert fix in str(excinfo.value)


def test_dtype_names_are_accepted_and_unsupported_ones_list_the_supported() -> None:
    supported = (torch.float32, torch.bfloat16)
    assert resolve_dtype("bfloat16", where="t", supported=supported) is torch.bfloat16
    assert resolve_dtype("torch.float32", where="t", supported=supported) is torch.float32
    with pytest.raises(UnsupportedDtypeError, match="supported: bfloat16, float32"):
        resolve_dtype("float16", where="t", supported=supported)
    with pytest.raises(UnsupportedDtypeError, match="not a torch dtype"):
        resolve_dtype("bf17", where="t")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_special_output_paths_are_refused_not_replaced(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.pt"
    os.mkfifo(fifo)
    with pytest.raises(UnsupportedOutputPathError, match="not a regular file or directory"):
        export_model("torchscript", small_model(), fifo)
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    with pytest.raises(UnsupportedOutputPathError):
        export_model("torchscript", small_model(), "/dev/null")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_key_path_under_a_regular_file_is_ignored_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from exportlm.export import trustkey

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("EXPORTLM_KEY_FILE", str(blocker / "key"))
    with pytest.warns(UserWarning, match="cannot read the exportlm signing key"):
        assert trustkey.sign(b"payload") is None


def test_a_code_executing_runtime_that_reopens_the_path_is_named(tmp_path: Path) -> None:
    """A third-party loader that opens the path itself gets no verified bytes: it is warned."""
    from exportlm.export import EXPORT_REGISTRY, RUNTIME_REGISTRY, export_target

    @export_target("h_reopens", runtime="h_reopens", executes_code=True)
    def write(model: torch.nn.Module, output_path: Path) -> Path:
        output_path.write_bytes(b"bytes")
        return output_path

    def reopen(artifact: Path) -> object:
        return artifact.read_bytes()

    EXPORT_REGISTRY.register("h_reopens", write)
    RUNTIME_REGISTRY.register("h_reopens", reopen)
    try:
        path = export_model("h_reopens", small_model(), tmp_path / "m.bin")
        with pytest.warns(UnverifiedArtifactWarning, match="not through .*open_artifact"):
            load_exported("h_reopens", path)
    finally:
        EXPORT_REGISTRY.unregister("h_reopens")
        RUNTIME_REGISTRY.unregister("h_reopens")
    built_in = export_quietly("torchscript", tmp_path / "m.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnverifiedArtifactWarning)
        load_exported("torchscript", built_in)  # the built-in runtimes read the verified bytes
