"""The conformance cache is data, not code: a tampered, truncated or foreign entry is never used.

Each test builds a real entry (the built-in ``torchscript`` target, whose format runs
code when loaded), tampers with it the way a poisoned CI cache would, and opens the
cache again: the entry must be refused with an :class:`ExportCheckWarning`, evicted
and rebuilt, the poison payload must never run, and the rebuilt artifact must load.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from exportlm.export import load_exported, trustkey
from exportlm.models import build_model as build_toy_model
from pytest_exportcheck import ExportCheckWarning
from pytest_exportcheck.checks._registries import Registries
from pytest_exportcheck.run._cache import ArtifactCache
from pytest_exportcheck.run._runner import SEED

TARGET = "torchscript"


class Poison:
    """Unpickling this touches a marker file: a harmless stand-in for arbitrary code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., object], tuple[object, ...]]:
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


@pytest.fixture(autouse=True)
def _own_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine's signing key lives in the test's directory, not in the user's home."""
    monkeypatch.setenv(trustkey.KEY_FILE_ENV, str(tmp_path / "key"))


def _cache(tmp_path: Path) -> ArtifactCache:
    return ArtifactCache(
        tmp_path / "session", tmp_path / "root", build_toy_model, Registries.installed()
    )


def _export(cache: ArtifactCache) -> Path:
    return cache.export(TARGET, {}, "decoder", suffix=".pt")


def _entry(artifact: Path) -> Path:
    return artifact.parent.parent


def _meta(entry: Path) -> dict[str, object]:
    data = json.loads((entry / "meta.json").read_text())
    assert isinstance(data, dict)
    return data


def _write_meta(entry: Path, meta: dict[str, object], *, sign: bool) -> None:
    """Rewrite meta.json as an attacker (no key: hashes only) or a local user (re-signed)."""
    meta = {k: v for k, v in meta.items() if k != "hmac"}
    if sign:
        canonical = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
        meta["hmac"] = trustkey.sign(canonical)
    (entry / "meta.json").chmod(0o644)
    (entry / "meta.json").write_text(json.dumps(meta))


def _rehash(entry: Path, meta: dict[str, object]) -> dict[str, object]:
    """Meta whose sha256 list matches the (tampered) files again."""
    out = entry / "out"
    files = {
        p.relative_to(out).as_posix(): {
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
            "size": p.stat().st_size,
        }
        for p in sorted(out.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }
    return {**meta, "files": files}


def _poison_file(path: Path, marker: Path) -> None:
    if path.exists():
        path.chmod(0o644)
    path.write_bytes(pickle.dumps(Poison(marker)))


def _assert_rebuilt(tmp_path: Path, marker: Path, reason: str) -> None:
    cache = _cache(tmp_path)
    with pytest.warns(ExportCheckWarning, match=reason) as caught:
        artifact = _export(cache)
    assert "not a failure of the target" in str(caught[0].message)
    assert cache.evicted == 1
    assert cache.misses == 1
    assert not marker.exists(), "the poisoned entry ran code"
    model = build_toy_model("decoder", SEED)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    expected = model(ids)[0] if isinstance(model(ids), tuple) else model(ids)
    got = load_exported(TARGET, artifact)(ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert not marker.exists()
    again = _cache(tmp_path)  # the rebuilt entry verifies: no warning, a hit
    _export(again)
    assert (again.hits, again.misses, again.evicted) == (1, 0, 0)


def test_the_poison_payload_is_live(tmp_path: Path) -> None:
    """The control: unpickling the payload does touch the marker."""
    marker = tmp_path / "marker"
    pickle.loads(pickle.dumps(Poison(marker)))
    assert marker.exists()


def test_an_entry_written_here_is_used_again(tmp_path: Path) -> None:
    first = _export(_cache(tmp_path))
    cache = _cache(tmp_path)
    assert _export(cache) == first
    assert (cache.hits, cache.misses, cache.evicted) == (1, 0, 0)


def test_a_replaced_artifact_with_rehashed_meta_is_rebuilt(tmp_path: Path) -> None:
    """An attacker without the key rewrites the artifact and the sha256 list: unsigned."""
    marker = tmp_path / "marker"
    entry = _entry(_export(_cache(tmp_path)))
    _poison_file(entry / "out" / "model.pt", marker)
    _write_meta(entry, _rehash(entry, _meta(entry)), sign=False)
    _assert_rebuilt(tmp_path, marker, "not signed with this user's exportlm key")


def test_a_changed_artifact_is_rebuilt(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    entry = _entry(_export(_cache(tmp_path)))
    _poison_file(entry / "out" / "model.pt", marker)
    _assert_rebuilt(tmp_path, marker, r"out/model\.pt does not match its sha256")


def test_a_truncated_artifact_is_rebuilt_not_blamed_on_the_target(tmp_path: Path) -> None:
    entry = _entry(_export(_cache(tmp_path)))
    artifact = entry / "out" / "model.pt"
    artifact.chmod(0o644)
    data = artifact.read_bytes()
    artifact.write_bytes(data[: len(data) // 2])
    _assert_rebuilt(tmp_path, tmp_path / "marker", "truncated or changed")


def test_a_truncated_meta_is_rebuilt(tmp_path: Path) -> None:
    entry = _entry(_export(_cache(tmp_path)))
    text = (entry / "meta.json").read_text()
    (entry / "meta.json").write_text(text[: len(text) // 2])
    _assert_rebuilt(tmp_path, tmp_path / "marker", "unreadable or truncated")


@pytest.mark.parametrize("where", ["absolute", "dotdot"])
def test_an_artifact_path_leaving_the_entry_is_never_followed(tmp_path: Path, where: str) -> None:
    """Even a meta.json signed with this key cannot point outside its entry."""
    marker = tmp_path / "marker"
    entry = _entry(_export(_cache(tmp_path)))
    outside = tmp_path / "evil.pt"
    _poison_file(outside, marker)
    name = str(outside) if where == "absolute" else os.path.relpath(outside, entry / "out")
    _write_meta(entry, {**_meta(entry), "artifact": name}, sign=True)
    _assert_rebuilt(tmp_path, marker, "a path that leaves the entry")


def test_a_symlink_in_an_entry_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    entry = _entry(_export(_cache(tmp_path)))
    outside = tmp_path / "evil.pt"
    _poison_file(outside, marker)
    artifact = entry / "out" / "model.pt"
    artifact.unlink()
    artifact.symlink_to(outside)
    _write_meta(entry, _meta(entry), sign=True)
    _assert_rebuilt(tmp_path, marker, r"out/model\.pt is a symbolic link")


def test_an_extra_file_in_an_entry_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    entry = _entry(_export(_cache(tmp_path)))
    _poison_file(entry / "out" / "model.pt.extra", marker)
    _assert_rebuilt(tmp_path, marker, r"extra \['model\.pt\.extra'\]")


def test_staging_directories_of_dead_writers_are_removed(tmp_path: Path) -> None:
    import fcntl

    entry = _entry(_export(_cache(tmp_path)))
    root = entry.parent
    dead = root / f".{entry.name}.k1ll3d"
    (dead / "out").mkdir(parents=True)
    (dead / "out" / "model.pt").write_bytes(b"half written" * 1000)
    other_key = "0" * 32
    live = root / f".{other_key}.writing"
    live.mkdir()
    with open(root / f"{other_key}.lock", "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)  # a writer still at work
        cache = _cache(tmp_path)
    assert not dead.exists()
    assert live.exists()
    assert _export(cache) == entry / "out" / "model.pt"
    shutil.rmtree(live)


def test_a_code_executing_artifact_whose_manifest_is_not_ours_is_rebuilt(tmp_path: Path) -> None:
    """The manifest is checked too: unsigned (re-signed by nobody) means not ours."""
    from exportlm.export.manifest import manifest_path

    entry = _entry(_export(_cache(tmp_path)))
    manifest = manifest_path(entry / "out" / "model.pt")
    data = json.loads(manifest.read_text())
    assert data.get("hmac"), "exports here sign their manifest"
    del data["hmac"]
    manifest.chmod(0o644)
    manifest.write_text(json.dumps(data))
    _write_meta(entry, _rehash(entry, _meta(entry)), sign=True)
    _assert_rebuilt(tmp_path, tmp_path / "marker", "manifest is not signed by this machine")
