"""Manifest schema 3 (BLAKE3 digests) and the schema-2 (sha256) manifests written before it.

A schema-2 manifest is built here as exportlm wrote it before schema 3: every file's
``{"sha256", "size"}``, ``model_sha256``, signed with this user's key over the same
canonical JSON. Those artifacts still verify and load, and every file's digest is still
checked: a changed byte is refused whichever digest the manifest lists.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch

from exportlm.errors import ArtifactIntegrityError
from exportlm.export import export_model, load_exported, trustkey
from exportlm.export.manifest import (
    MANIFEST_SCHEMA,
    file_digest,
    manifest_path,
    read_manifest,
    verify_artifact,
)
from exportlm.models import DecoderConfig, DecoderModel, tiny_hf_model

IDS = torch.tensor([[1, 2, 3, 4]])


@pytest.fixture(autouse=True)
def _key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXPORTLM_KEY_FILE", str(tmp_path / "home" / "key"))


def _export(target: str, model: Any, path: Path, **options: Any) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return export_model(target, model, path, **options)


def _torchscript(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = DecoderModel(DecoderConfig(hidden_size=32, intermediate_size=64, num_layers=1))
    return _export("torchscript", model.eval(), tmp_path / "m.pt", method="trace")


def _rewrite(artifact: Path, change: Any) -> None:
    """Apply ``change`` to the artifact's manifest data and sign it again with this user's key."""
    path = manifest_path(artifact)
    data = json.loads(path.read_text())
    data.pop("hmac")
    change(data, artifact if artifact.is_dir() else artifact.parent)
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    data["hmac"] = trustkey.sign(canonical.encode())
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _schema_2(data: dict[str, Any], root: Path) -> None:
    """What exportlm wrote before schema 3: sha256 of every file, ``model_sha256``."""
    data["schema"] = 2
    data.pop("model_blake3")
    data["model_sha256"] = hashlib.sha256(b"the model").hexdigest()
    data["files"] = {
        name: {"sha256": hashlib.sha256((root / name).read_bytes()).hexdigest(), "size": size}
        for name, size in ((n, e["size"]) for n, e in data["files"].items())
    }


def test_schema_3_lists_the_blake3_of_every_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXPORTLM_MODEL_HASH", "1")  # the model hash is asked for
    out = _export("hf_checkpoint", tiny_hf_model("llama", num_hidden_layers=1), tmp_path / "c")
    manifest = verify_artifact(out)
    assert MANIFEST_SCHEMA == 3
    assert (manifest.schema, manifest.digest) == (3, "blake3")
    for name, entry in manifest.files.items():
        data = (out / name).read_bytes()
        assert entry == {"blake3": blake3.blake3(data).hexdigest(), "size": len(data)}
        assert file_digest(out / name) == entry["blake3"]  # the one digest, public
    assert manifest.model_hash is not None
    assert "model_blake3" in manifest.data


def test_a_schema_2_file_artifact_still_verifies_and_loads_as_vouched(tmp_path: Path) -> None:
    path = _torchscript(tmp_path)
    _rewrite(path, _schema_2)
    manifest = read_manifest(path)
    assert manifest is not None
    assert (manifest.schema, manifest.digest) == (2, "sha256")
    assert manifest.model_hash == hashlib.sha256(b"the model").hexdigest()
    assert manifest.is_own()
    runtime = load_exported("torchscript", path)  # no trust=True: the manifest vouches
    assert runtime(IDS).shape == (1, 4, 256)


def test_a_schema_2_directory_still_verifies_and_a_changed_byte_is_refused(
    tmp_path: Path,
) -> None:
    out = _export("hf_checkpoint", tiny_hf_model("llama", num_hidden_layers=1), tmp_path / "c")
    _rewrite(out, _schema_2)
    assert verify_artifact(out).schema == 2
    assert load_exported("hf_checkpoint", out) is not None
    config = out / "config.json"
    config.write_bytes(config.read_bytes().replace(b"{", b"{ ", 1)[:-1])  # same size
    with pytest.raises(ArtifactIntegrityError, match=r"config\.json does not match its sha256"):
        verify_artifact(out)


def test_a_changed_byte_under_schema_3_is_refused_on_load(tmp_path: Path) -> None:
    path = _torchscript(tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactIntegrityError, match=r"m\.pt does not match its blake3 digest"):
        load_exported("torchscript", path, trust=True)  # trust never waives the digest


@pytest.mark.parametrize(
    ("schema", "key"), [(3, "sha256"), (2, "blake3")], ids=["sha256-in-3", "blake3-in-2"]
)
def test_a_digest_other_than_the_schemas_is_refused(tmp_path: Path, schema: int, key: str) -> None:
    # each schema has one digest: a schema-3 manifest listing sha256 (or a schema-2 one
    # listing BLAKE3) vouches for nothing, even with the right value
    path = _torchscript(tmp_path)
    algorithms = {"sha256": hashlib.sha256, "blake3": blake3.blake3}

    def relist(data: dict[str, Any], root: Path) -> None:
        data["schema"] = schema
        data["files"] = {
            n: {key: algorithms[key]((root / n).read_bytes()).hexdigest(), "size": e["size"]}
            for n, e in data["files"].items()
        }

    _rewrite(path, relist)
    with pytest.raises(ArtifactIntegrityError, match="does not match its"):
        verify_artifact(path)
