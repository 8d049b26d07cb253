"""The failure memo and the artifact cache: a backend upgrade and planted lock links.

A remembered failure is replayed only under the same library versions (the cache
key's, read from installed metadata), and says which; a lock path in the cache that
is a symbolic link is never followed (it used to make a run create ``.git/index.lock``
or an empty signing key).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from exportlm.errors import UnsafeLockFileError
from exportlm.safeio import exclusive_lock, open_lock_file
from pytest_exportcheck.run._failure_memo import ExportFailureMemo

PLUGIN = """
import importlib.metadata
import os

from exportlm.errors import ExportFailedError
from exportlm.export import export_target


@export_target("backendfail", runtime="torchscript", suffix=".pt", atol=1e-5, rtol=1e-5)
def export_backendfail(model, output_path, *, example_inputs=None):
    version = importlib.metadata.version("fakebackend")
    with open(os.environ["FAKEBACKEND_LOG"], "a") as log:
        log.write(version + "\\n")
    raise ExportFailedError(f"fakebackend {version} cannot export this graph")
"""

CONFTEST = """
from exportlm.export import EXPORT_REGISTRY, ensure_exporters_registered
import fakeplugin

ensure_exporters_registered()
EXPORT_REGISTRY.register("backendfail", fakeplugin.export_backendfail)
"""

ARGS = [
    "--export-targets=backendfail",
    "--export-exporters=none",
    "--export-models=decoder",
    "--export-checks=roundtrip_logits",
    "--export-only",
    "-p",
    "no:randomly",
]


def _dist(site: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    """An installed distribution ``name`` in ``site``, as pip leaves one (no other)."""
    for old in site.glob(f"{name}-*.dist-info"):
        for file in old.iterdir():
            file.unlink()
        old.rmdir()
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    (info / "top_level.txt").write_text(f"{name}\n")


@pytest.fixture
def plugin_site(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = pytester.path / "site"
    (site / "fakeplugin").mkdir(parents=True)
    (site / "fakeplugin" / "__init__.py").write_text(PLUGIN)
    _dist(site, "fakeplugin", "1.0", requires=("fakebackend>=1.0",))
    _dist(site, "fakebackend", "1.0")
    pytester.makeconftest(CONFTEST)
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), *([path] if path else [])]))
    monkeypatch.setenv("FAKEBACKEND_LOG", str(pytester.path / "exports.log"))
    return site


def _exports(pytester: pytest.Pytester) -> list[str]:
    return (pytester.path / "exports.log").read_text().split()


def test_a_backend_upgrade_runs_a_remembered_failure_again(
    pytester: pytest.Pytester, plugin_site: Path
) -> None:
    first = pytester.runpytest_subprocess(*ARGS)
    first.assert_outcomes(passed=1, failed=1)
    assert _exports(pytester) == ["1.0"]
    # Same versions: the failure is replayed, and says what it was remembered with.
    second = pytester.runpytest_subprocess(*ARGS)
    second.assert_outcomes(passed=1, failed=1)
    assert _exports(pytester) == ["1.0"], "the remembered failure was exported again"
    text = second.stdout.str()
    assert "remembered from a run with fakeplugin 1.0, fakebackend 1.0" in text
    assert "--export-no-cache" in text
    # The backend is upgraded: the target's export runs again, nothing is replayed.
    _dist(plugin_site, "fakebackend", "1.1")
    third = pytester.runpytest_subprocess(*ARGS)
    third.assert_outcomes(passed=1, failed=1)
    assert _exports(pytester) == ["1.0", "1.1"], "the failure of fakebackend 1.0 was replayed"
    assert "remembered from a run" not in third.stdout.str()
    assert "fakebackend 1.1 cannot export this graph" in third.stdout.str()


# ----------------------------------------------------------------------------- lock files


def test_a_planted_lock_link_is_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "repo" / ".git" / "index.lock"
    victim.parent.mkdir(parents=True)
    lock = tmp_path / "k.lock"
    lock.symlink_to(victim)  # dangling: opening it with O_CREAT would create the victim
    with pytest.raises(UnsafeLockFileError, match="symbolic link"):
        open_lock_file(lock)
    assert not victim.exists()
    existing = tmp_path / "key"
    existing.write_bytes(b"k" * 32)
    other = tmp_path / "other.lock"
    other.symlink_to(existing)
    with pytest.raises(UnsafeLockFileError, match="Remove"), exclusive_lock(other):
        pass
    assert existing.read_bytes() == b"k" * 32


def test_a_lock_file_is_created_private_and_reused(tmp_path: Path) -> None:
    lock = tmp_path / "k.lock"
    with exclusive_lock(lock):
        assert lock.stat().st_mode & 0o777 == 0o600
    with exclusive_lock(lock):  # the existing one is opened again
        pass
    os.link(lock, tmp_path / "second-name")
    with pytest.raises(UnsafeLockFileError, match="2 hard links"):
        open_lock_file(lock)
    fifo = tmp_path / "fifo.lock"
    os.mkfifo(fifo)
    with pytest.raises(UnsafeLockFileError, match="FIFO"):
        open_lock_file(fifo)  # and it did not block


def test_a_planted_memo_lock_neither_creates_its_target_nor_replays(tmp_path: Path) -> None:
    victim = tmp_path / "signing-key"
    memo = ExportFailureMemo(tmp_path / "failures")
    (tmp_path / "failures").mkdir()
    (tmp_path / "failures" / "abc.lock").symlink_to(victim)
    with pytest.warns(match="neither replayed nor remembered"), memo.exclusive("abc"):
        assert memo.recall("abc") is None
    assert not os.path.lexists(victim)


CACHE_ARGS = [
    "--export-targets=torchscript",
    "--export-models=decoder",
    "--export-checks=roundtrip_logits",
    "-p",
    "no:randomly",
    "-W",
    "always::pytest_exportcheck.ExportCheckWarning",
]


def test_planted_lock_links_in_the_cache_create_nothing(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = tmp_path / "home" / "key"
    monkeypatch.setenv("EXPORTLM_KEY_FILE", str(key))
    pytester.runpytest(*CACHE_ARGS).assert_outcomes(passed=3, xfailed=1)
    root = pytester.path / ".pytest_cache" / "d" / "exportcheck" / "artifacts"
    entries = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert entries
    key.unlink()  # a first run: no key yet, and the links point where it will be created
    git = pytester.path / ".git"
    git.mkdir()
    for entry in entries:  # the entry is gone, its lock is a link
        for path in entry.rglob("*"):
            path.chmod(0o700)
        shutil.rmtree(entry)
        (root / f"{entry.name}.lock").unlink()
        (root / f"{entry.name}.lock").symlink_to(key if entry == entries[0] else git / "index.lock")
    dead = "f" * 32  # a dead writer's staging directory, swept with its (planted) lock
    (root / f".{dead}.abcd").mkdir()
    (root / f"{dead}.lock").symlink_to(git / "index.lock")
    result = pytester.runpytest(*CACHE_ARGS)
    result.assert_outcomes(passed=3, xfailed=1)
    assert not os.path.lexists(git / "index.lock"), "a planted lock link created .git/index.lock"
    assert key.stat().st_size == 32, "the key was spoiled"
    assert key.stat().st_mode & 0o777 == 0o600
    result.stdout.fnmatch_lines(["*lock file * is a symbolic link*outside the cross-run cache*"])


# ----------------------------------------------------------------------------- the signing key


def _spoil(key: Path, how: str) -> None:
    key.parent.mkdir(parents=True, exist_ok=True)
    if how == "symlink":
        real = key.parent / "real-key"
        real.write_bytes(b"k" * 32)
        real.chmod(0o600)
        key.symlink_to(real)
    elif how == "directory":
        key.mkdir()
    else:
        key.write_bytes({"empty": b"", "wrong-size": b"k" * 16}.get(how, b"k" * 32))
        key.chmod(0o644 if how == "group-readable" else 0o600)


@pytest.mark.parametrize("how", ["empty", "wrong-size", "group-readable", "symlink", "directory"])
def test_an_unusable_key_is_reported_once_and_fails_no_target(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    key = tmp_path / "home" / "key"
    _spoil(key, how)
    before = key.read_bytes() if key.is_file() else None
    monkeypatch.setenv("EXPORTLM_KEY_FILE", str(key))
    args = [*CACHE_ARGS, "--export-checks=roundtrip_logits,trust"]
    result = pytester.runpytest(*args)
    result.assert_outcomes(passed=4, xfailed=2)  # as with a usable key: nothing fails
    text = result.stdout.str()
    assert text.count(str(key)) == 1, "the key's problem is not reported exactly once"
    result.stdout.fnmatch_lines(["*signing key*temporary key of its own*no target was failed*"])
    assert os.environ["EXPORTLM_KEY_FILE"] == str(key), "the run's own key outlived it"
    assert (key.read_bytes() if key.is_file() else None) == before, "the user's key was changed"
    assert not (pytester.path / ".pytest_cache" / "d" / "exportcheck" / "artifacts").exists()
