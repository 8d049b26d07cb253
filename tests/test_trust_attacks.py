"""The attacks of the adversarial review on the trust boundary, replayed through the public API.

Every "evil" file here carries a live payload: loading it with the target's own runtime
loader writes a marker file (the control tests prove it). Each attack must end with the
marker absent and a specific exportlm error, or with the genuine artifact loaded.

* a manifest copied beside another file (``evil.pt2.manifest.json`` = ``good.pt2``'s);
* a path swapped with ``renameat2(RENAME_EXCHANGE)`` while ``load_exported`` runs;
* two signed artifact-cache entries whose contents were exchanged.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from exportlm.errors import ArtifactIntegrityError, UntrustedArtifactError
from exportlm.export import (
    EXPORT_REGISTRY,
    RUNTIME_REGISTRY,
    export_model,
    export_target,
    load_exported,
    runtime_loader,
    trustkey,
)
from exportlm.export.guard import open_artifact
from exportlm.export.manifest import manifest_path
from tests._payload import Payload, export_quietly, small_model

_IDS = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
SUFFIX = {"torch_export": ".pt2", "torchscript": ".pt"}
TARGETS = sorted(SUFFIX)

# A Python-backed op that any TorchScript in this process can call: the stand-in for what
# TorchScript reaches when it is loaded (its __setstate__ runs on torch.jit.load).
_LIB = torch.library.Library("exportlm_attack", "DEF")
_LIB.define("touch(str path) -> int")


def _touch(path: str) -> int:
    pathlib.Path(path).write_text("pwned")
    return 1


_LIB.impl("touch", _touch, "CompositeExplicitAutograd")


@pytest.fixture(autouse=True)
def _own_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(trustkey.KEY_FILE_ENV, str(tmp_path / "home" / "key"))


class _Touching(torch.nn.Module):
    """A TorchScript module whose ``__setstate__`` (run by ``torch.jit.load``) writes the marker."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids.float()

    @torch.jit.export
    def __getstate__(self) -> list[str]:
        return [self.marker]

    @torch.jit.export
    def __setstate__(self, state: list[str]) -> None:
        self.marker = state[0]
        self.training = torch.ops.exportlm_attack.touch(state[0]) < 0


def _evil_pt2(good: Path, evil: Path, marker: Path) -> None:
    """``good``'s archive with its first weight replaced by a pickle that writes ``marker``."""
    with zipfile.ZipFile(good) as archive:
        records = {i.filename.split("/", 1)[1]: archive.read(i) for i in archive.infolist()}
    config_name = "data/weights/model_weights_config.json"
    config = json.loads(records[config_name])
    first = next(iter(config["config"].values()))
    first["use_pickle"] = True  # torch.export.load then torch.load(weights_only=False)s it
    records[config_name] = json.dumps(config).encode()
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    records[f"data/weights/{first['path_name']}"] = buffer.getvalue()
    writer = torch._C.PyTorchFileWriter(str(evil))
    for name, data in records.items():
        if not name.startswith(".data/"):  # the writer adds its own
            writer.write_record(name, data, len(data))
    writer.write_end_of_file()


def _evil_pt(evil: Path, marker: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.script(_Touching(str(marker))), str(evil))


def _evil(target: str, good: Path, evil: Path, marker: Path) -> Path:
    if target == "torch_export":
        _evil_pt2(good, evil, marker)
    else:
        _evil_pt(evil, marker)
    return evil


@pytest.mark.parametrize("target", TARGETS)
def test_the_evil_payloads_are_live(target: str, tmp_path: Path) -> None:
    """The control: the target's own loader, given the evil file directly, runs the payload."""
    marker = tmp_path / "marker"
    good = export_quietly(target, tmp_path / f"good{SUFFIX[target]}")
    evil = _evil(target, good, tmp_path / f"evil{SUFFIX[target]}", marker)
    with warnings.catch_warnings(), contextlib.suppress(Exception):
        warnings.simplefilter("ignore")
        runtime_loader(target)(evil)  # the .pt2 payload leaves no working model: it raises
    assert marker.read_text() == "pwned"


@pytest.mark.parametrize("trust", [False, True], ids=["untrusted", "trust"])
@pytest.mark.parametrize("target", TARGETS)
def test_a_copied_manifest_vouches_for_nothing(target: str, trust: bool, tmp_path: Path) -> None:
    """``evil.pt2.manifest.json`` copied from ``good.pt2``'s: refused before the loader runs."""
    marker = tmp_path / "marker"
    suffix = SUFFIX[target]
    good = export_quietly(target, tmp_path / f"good{suffix}")
    evil = _evil(target, good, tmp_path / f"evil{suffix}", marker)
    shutil.copy(manifest_path(good), manifest_path(evil))
    with pytest.raises(ArtifactIntegrityError) as excinfo:
        load_exported(target, evil, trust=trust)
    message = str(excinfo.value)
    assert f"vouches for {good.name!r}, not for {evil.name!r}" in message
    assert "rename" in message
    assert "re-export" in message
    assert not marker.exists(), "the copied manifest let the payload run"
    assert load_exported(target, good)(_IDS).shape == (2, 4, 256)  # the original still loads


@pytest.mark.parametrize("target", TARGETS)
def test_a_renamed_artifact_is_not_vouched_for_under_its_new_name(
    target: str, tmp_path: Path
) -> None:
    good = export_quietly(target, tmp_path / f"good{SUFFIX[target]}")
    renamed = tmp_path / f"renamed{SUFFIX[target]}"
    good.rename(renamed)
    manifest_path(good).rename(manifest_path(renamed))
    with pytest.raises(ArtifactIntegrityError, match="rename it and its manifest back"):
        load_exported(target, renamed)
    renamed.rename(good)
    manifest_path(renamed).rename(manifest_path(good))
    assert load_exported(target, good)(_IDS).shape == (2, 4, 256)


def test_a_manifest_of_another_target_does_not_vouch(tmp_path: Path) -> None:
    """A torchscript ``.pt`` with its own manifest, loaded as ``torch_export``: not vouched for."""
    pt = export_quietly("torchscript", tmp_path / "m.pt")
    with pytest.raises(UntrustedArtifactError, match="written for target 'torchscript'"):
        load_exported("torch_export", pt)


# --- what loads is what was verified ---------------------------------------------------------


@pytest.mark.parametrize("mode", [0o644, 0o666], ids=["private-file", "world-writable-file"])
def test_the_loader_reads_the_verified_bytes_after_the_path_was_replaced(
    mode: int, tmp_path: Path
) -> None:
    """The attacker wins the race every time: the path is replaced after the check, before the
    loader opens it. The loader (through ``open_artifact``) still reads the verified bytes."""

    @export_target("h_attack_bytes", runtime="h_attack_bytes", executes_code=True)
    def write(model: torch.nn.Module, output_path: Path) -> Path:
        output_path.write_bytes(b"genuine bytes")
        return output_path

    read: list[bytes] = []

    def load(artifact: Path) -> Callable[[torch.Tensor], torch.Tensor]:
        evil = artifact.with_name("evil")
        evil.write_bytes(b"evil bytes")
        os.replace(evil, artifact)
        with open_artifact(artifact) as handle:
            read.append(handle.read())
        return lambda ids: ids

    EXPORT_REGISTRY.register("h_attack_bytes", write)
    RUNTIME_REGISTRY.register("h_attack_bytes", load)
    try:
        path = export_model("h_attack_bytes", small_model(), tmp_path / "m.bin")
        path.chmod(mode)  # world-writable: the loader reads a private copy made while hashing
        load_exported("h_attack_bytes", path)
    finally:
        EXPORT_REGISTRY.unregister("h_attack_bytes")
        RUNTIME_REGISTRY.unregister("h_attack_bytes")
    assert read == [b"genuine bytes"]
    assert path.read_bytes() == b"evil bytes"  # the path itself did change


# --- the path-swap race --------------------------------------------------------------------

#: Runs in its own process (no shared GIL). The attacker of the review, made sharper: it
#: watches the directory with inotify and, each time a reader closes argv[1] (the loader's
#: check has just hashed it), exchanges argv[1] and argv[2] with renameat2(RENAME_EXCHANGE),
#: so the next open by path names the other file. Without inotify or renameat2 it falls back
#: to a tight loop (alternating argv[1] between the two files with os.replace). Stops once
#: the file argv[3] exists (any event wakes it) and prints how many swaps it made.
_SWAPPER = r"""
import ctypes, errno, os, platform, struct, sys, time
a, b, stop = sys.argv[1], sys.argv[2], sys.argv[3]
name = os.fsencode(os.path.basename(a))
number = {"x86_64": 316, "aarch64": 276}.get(platform.machine())
libc = ctypes.CDLL(None, use_errno=True)

def exchange():
    if libc.syscall(number, -100, os.fsencode(a), -100, os.fsencode(b), 2) != 0:
        raise OSError(ctypes.get_errno(), "renameat2")

def alternate(state=[0]):
    os.link(a + ".good" if state[0] else b, a + ".next")
    os.replace(a + ".next", a)
    state[0] ^= 1

step = exchange if number else alternate
try:
    exchange() if number else None
    exchange() if number else None
except OSError as err:
    if err.errno not in (errno.ENOSYS, errno.EINVAL):
        raise
    step = alternate
if step is alternate:
    os.link(a, a + ".good")
watch = libc.inotify_init1(0) if hasattr(libc, "inotify_init1") else -1
if watch >= 0 and libc.inotify_add_watch(watch, os.fsencode(os.path.dirname(a)), 0x18) < 0:
    watch = -1
print("ready", flush=True)
swaps, deadline = 0, time.monotonic() + 120
while not os.path.exists(stop) and time.monotonic() < deadline:
    if watch < 0:
        for _ in range(256):
            step()
        swaps += 256
        continue
    data, offset = os.read(watch, 65536), 0
    while offset < len(data):
        _, mask, _, length = struct.unpack_from("iIII", data, offset)
        event = data[offset + 16 : offset + 16 + length].rstrip(b"\0")
        offset += 16 + length
        if event == name and mask & 0x10:
            step()
            swaps += 1
print(swaps, flush=True)
"""


class _Swapper:
    """A process that swaps ``a`` and ``b`` as fast as it can while the ``with`` block runs."""

    def __init__(self, a: Path, b: Path) -> None:
        self.args = [sys.executable, "-c", _SWAPPER, str(a), str(b), str(a.parent / ".stop")]
        self.stop = a.parent / ".stop"
        self.swaps = 0

    def __enter__(self) -> _Swapper:
        self.process = subprocess.Popen(self.args, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        assert self.process.stdout.readline().strip() == "ready"
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.touch()
        out, _ = self.process.communicate(timeout=30)
        assert self.process.returncode == 0, f"the swapper failed: {out}"
        self.swaps = int(out.strip() or 0)


@pytest.mark.parametrize("mode", [0o644, 0o666], ids=["private-file", "world-writable-file"])
@pytest.mark.parametrize("target", TARGETS)
def test_a_path_swapped_during_load_never_runs_the_payload(
    target: str, mode: int, tmp_path: Path
) -> None:
    """40 loads while another process exchanges the artifact with an evil file: the payload never runs.

    Each load either refuses (the path named the evil file when it was opened: its bytes
    do not match the manifest) or loads the genuine artifact, never the bytes it did not
    verify. A world-writable file is copied privately before it is hashed.
    """
    marker = tmp_path / "marker"
    shared = tmp_path / "shared"
    shared.mkdir()
    path = export_quietly(target, shared / f"model{SUFFIX[target]}")
    evil = _evil(target, path, shared / f".incoming{SUFFIX[target]}", marker)
    for file in (path, evil):
        file.chmod(mode)
    loaded, refusals = 0, []
    swapper = _Swapper(path, evil)
    with swapper, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(40):
            try:
                runtime = load_exported(target, path)
            except ArtifactIntegrityError as err:
                refusals.append(str(err))
            else:
                assert runtime(_IDS).shape == (2, 4, 256)  # the genuine model, not the payload
                loaded += 1
            assert not marker.exists(), f"the payload ran after {loaded} loads, {refusals}"
    # The swapper raced: the path named the genuine file at some loads, the evil one at others.
    assert swapper.swaps >= 20
    assert loaded
    assert refusals
    assert loaded + len(refusals) == 40
    assert all("does not match its blake3 digest" in text for text in refusals), refusals


# --- swapped artifact-cache entries --------------------------------------------------------


def test_swapped_cache_entries_are_evicted_and_rebuilt(tmp_path: Path) -> None:
    """Two signed entries whose contents were exchanged: each is refused under the other's key."""
    from exportlm.models import build_model as build_toy_model
    from pytest_exportcheck import ExportCheckWarning
    from pytest_exportcheck.checks._registries import Registries
    from pytest_exportcheck.run._cache import ArtifactCache
    from pytest_exportcheck.run._runner import SEED

    def cache() -> ArtifactCache:
        return ArtifactCache(
            tmp_path / "session", tmp_path / "root", build_toy_model, Registries.installed()
        )

    first = cache()
    a = first.export("torchscript", {}, "decoder", seed=SEED, suffix=".pt").parent.parent
    b = first.export("torchscript", {}, "decoder", seed=SEED + 1, suffix=".pt").parent.parent
    assert a != b
    spare = a.with_name("spare")
    os.rename(a, spare)
    os.rename(b, a)
    os.rename(spare, b)
    again = cache()
    with pytest.warns(ExportCheckWarning, match="written for another cache key") as caught:
        artifact = again.export("torchscript", {}, "decoder", seed=SEED, suffix=".pt")
    assert "not a failure of the target" in str(caught[0].message)
    assert (again.hits, again.misses, again.evicted) == (0, 1, 1)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    model = build_toy_model("decoder", SEED)
    out = model(ids)
    expected = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(load_exported("torchscript", artifact)(ids), expected)
