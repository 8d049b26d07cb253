"""``exportlm export --verify`` and ``--trust``: the trust boundary on the command line.

The only command that loads an artifact is ``export --verify``, and it loads the one it
has just written. That artifact's manifest proves it is this machine's own only when
the export could sign it with this user's key; when the key is unusable (here: a key
file others can read, which proves nothing and is ignored), the manifest is unsigned:
not this machine's, as if it came from elsewhere, and a code-executing format is
refused without ``--trust``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from exportlm.cli import main
from exportlm.export.manifest import manifest_path, read_manifest


def _export(out: Path, *extra: str) -> list[str]:
    return ["export", "--target", "torch_export", "--model", "decoder", "--out", str(out), *extra]


@pytest.fixture
def unsigned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A world-readable signing key: ignored, so every manifest is written unsigned."""
    key = tmp_path / "key"
    key.write_bytes(bytes(range(32)))
    key.chmod(0o644)
    monkeypatch.setenv("EXPORTLM_KEY_FILE", str(key))


@pytest.mark.usefixtures("unsigned")
@pytest.mark.filterwarnings("ignore:exportlm signing key .* is not a private file")
def test_verify_refuses_an_unsigned_code_artifact_without_trust(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.pt2"
    assert main(_export(out, "--verify")) == 1  # exit 1: the verification could not run
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("exportlm: error")]
    assert line.startswith(f"exportlm: error: refusing to load {out}: ")  # the file
    assert "execute arbitrary code" in line  # the risk
    assert "--trust" in line  # the fix
    assert "not signed by this machine" in line  # why it is not proven ours
    manifest = read_manifest(out)
    assert manifest is not None
    assert not manifest.is_own()
    assert manifest_path(out).is_file()


@pytest.mark.usefixtures("unsigned")
@pytest.mark.filterwarnings("ignore:exportlm signing key .* is not a private file")
def test_verify_with_trust_loads_it_and_compares_logits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.pt2"
    assert main(_export(out, "--verify", "--trust")) == 0
    assert capsys.readouterr().out.rstrip().endswith(": OK")


def test_verify_of_our_own_signed_export_needs_no_trust(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("EXPORTLM_KEY_FILE", str(tmp_path / "home" / "key"))
    out = tmp_path / "m.pt2"
    assert main(_export(out, "--verify")) == 0
    assert capsys.readouterr().out.rstrip().endswith(": OK")
    manifest = read_manifest(out)
    assert manifest is not None
    assert manifest.is_own()
