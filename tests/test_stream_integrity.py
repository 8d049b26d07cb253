"""A resumed or concurrent streaming export never publishes bytes its model did not produce.

Each test is an attack on the work area of ``export_streaming`` (the state a killed run
leaves for the next to continue): two runs at once, a model swapped under a killed run,
an edited progress record, planted work files, a FIFO for the record, and entries planted
beside the output in a shared directory. The run afterwards must publish the export of
the model as it is now (byte for byte the uninterrupted export), or refuse with an
exportlm error, and leave everything it does not own alone. See ``docs/security.md``
("Resumed and concurrent streamed exports").
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from exportlm.errors import StreamIntegrityError
from exportlm.stream import export_streaming
from tests._stream_models import MANIFEST, different_files, llama_directory

SHARD = "100KB"
RECIPE = "fp8"

#: Runs one export; at "layer K done" it SIGKILLs itself ("kill"), or says so in
#: SIGNALS/paused and waits for SIGNALS/go ("pause").
_CHILD = textwrap.dedent(
    """
    import logging, os, signal, sys, time
    from pathlib import Path
    from exportlm.stream import export_streaming

    src, out, recipe, after, mode, signals, overwrite = sys.argv[1:8]

    class Stop(logging.Handler):
        def emit(self, record):
            if not record.getMessage().startswith(f"layer {after} done"):
                return
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            Path(signals, "paused").touch()
            deadline = time.monotonic() + 300
            while not Path(signals, "go").exists():
                if time.monotonic() > deadline:
                    os._exit(3)
                time.sleep(0.05)

    logger = logging.getLogger("exportlm.stream")
    logger.setLevel(logging.INFO)
    logger.addHandler(Stop())
    export_streaming(src, out, recipe=recipe, max_shard_size="100KB", overwrite=overwrite == "1")
    """
)


def _child(
    src: Path, out: Path, recipe: str, after: int, mode: str, signals: Path, overwrite: bool
) -> Any:
    signals.mkdir(exist_ok=True)
    args = [sys.executable, "-c", _CHILD, str(src), str(out), recipe, str(after), mode]
    return subprocess.Popen(
        [*args, str(signals), "1" if overwrite else "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _kill_after(src: Path, out: Path, layer: int, recipe: str = RECIPE) -> None:
    """A streaming export of ``src`` to ``out`` SIGKILLed once layer ``layer`` is recorded."""
    child = _child(src, out, recipe, layer, "kill", out.parent / f"signals-{out.name}", False)
    _, err = child.communicate(timeout=300)
    assert child.returncode == -signal.SIGKILL, err[-2000:]
    assert not out.exists()


def _work_dirs(out: Path) -> list[Path]:
    """The work areas a streaming export of ``out`` left (any layout)."""
    return sorted(p for p in out.parent.glob(f".{out.name}.stream*") if p.is_dir())


def _the_work_dir(out: Path) -> Path:
    (work,) = _work_dirs(out)
    return work


def _export(src: Path, out: Path) -> Path:
    return export_streaming(src, out, recipe=RECIPE, max_shard_size=SHARD)


def _same_export(expected: Path, out: Path) -> None:
    assert different_files(expected, out, skip=(MANIFEST,)) == []


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``src/`` (a 4-layer Llama), ``ref/`` (its uninterrupted export) and the work area a
    run to ``out/`` left when it was killed after layer 1; each test works on a copy."""
    root = tmp_path_factory.mktemp("killed")
    src = llama_directory(root, tied=False, layers=4)
    _export(src, root / "ref")
    _kill_after(src, root / "out", 1)
    return root


@pytest.fixture
def site(killed: Path, tmp_path: Path) -> Path:
    """A copy of :func:`killed` (the work area keeps its name, mode and files)."""
    copy = tmp_path / "site"
    shutil.copytree(killed, copy, symlinks=True)
    return copy


def test_an_untouched_copy_of_a_killed_run_resumes(
    site: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # the control: without the attacks below, the copied work area is continued
    with caplog.at_level("INFO", logger="exportlm.stream"):
        out = _export(site / "src", site / "out")
    assert "resuming after layer 2 of 4" in caplog.text
    _same_export(site / "ref", out)


def _edit_record(work: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``edit`` to the progress record in ``work`` (signed or not) and write it back."""
    path = work / "progress.json"
    data = json.loads(path.read_text())
    edit(data.get("record", data))
    path.write_text(json.dumps(data))


# ----------------------------------------------------------------- two runs at once


def test_two_overlapping_exports_to_one_output_each_publish_their_own_bytes(
    tmp_path: Path,
) -> None:
    src = llama_directory(tmp_path, tied=False, layers=3)
    recipes = {"a": "fp8", "b": "int8_wo"}
    refs = {
        k: export_streaming(src, tmp_path / f"ref-{k}", recipe=r, max_shard_size=SHARD)
        for k, r in recipes.items()
    }
    out = tmp_path / "out"
    runs = {}
    for name, recipe in recipes.items():  # a pauses after layer 0, then b starts and pauses
        runs[name] = _child(src, out, recipe, 0, "pause", tmp_path / name, True)
        deadline = time.monotonic() + 300
        while not (tmp_path / name / "paused").exists():
            assert runs[name].poll() is None, runs[name].communicate()[1][-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
    published = 0
    for name in ("a", "b"):  # a finishes while b is in the middle of its run, then b
        (tmp_path / name / "go").touch()
        _, err = runs[name].communicate(timeout=300)
        if runs[name].returncode == 0:
            _same_export(refs[name], out)  # what it published is its own export
            published += 1
        else:  # a refusal must be exportlm's, with a message: never a raw error
            assert "exportlm.errors." in err, err[-2000:]
    assert published >= 1
    assert _work_dirs(out) == []


# ----------------------------------------------------------------- a model swapped


def test_a_run_after_the_model_was_swapped_starts_over_on_the_new_model(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = llama_directory(tmp_path, tied=False, layers=4, seed=0)
    out = tmp_path / "out"
    _kill_after(src, out, 1)
    before = {p.name: p.stat() for p in src.iterdir()}
    shutil.rmtree(src)
    llama_directory(tmp_path, tied=False, layers=4, seed=1)  # another model, same shapes
    for name, info in before.items():  # same sizes and mtimes: only the bytes differ
        assert (src / name).stat().st_size == info.st_size
        os.utime(src / name, ns=(info.st_atime_ns, info.st_mtime_ns))
    expected = _export(src, tmp_path / "ref")
    with caplog.at_level("INFO", logger="exportlm.stream"):
        _export(src, out)
    assert "resuming after" not in caplog.text
    assert "the model's files are not those it was started on" in caplog.text
    _same_export(expected, out)
    assert _work_dirs(out) == []  # the old model's work area was removed, not continued


def test_a_model_directory_of_links_is_hashed_through_them(
    killed: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # files that are links (inside the directory, as the loader requires): the key follows
    # the links the reads do, and a work file's digest is still its own
    snapshot = tmp_path / "snapshot"
    blobs = snapshot / "blobs"
    shutil.copytree(killed / "src", blobs)
    for blob in blobs.iterdir():
        (snapshot / blob.name).symlink_to(blob)
    _kill_after(snapshot, tmp_path / "out", 0)
    with caplog.at_level("INFO", logger="exportlm.stream"):
        _same_export(killed / "ref", _export(snapshot, tmp_path / "out"))
    assert "resuming after layer 1 of 4" in caplog.text


# ----------------------------------------------------------------- edited records


def test_a_record_edited_to_skip_a_layer_is_not_continued(site: Path) -> None:
    work = _the_work_dir(site / "out")

    def skip_layer(record: dict[str, Any]) -> None:
        done = record["layers_done"]
        record["layers"].append(dict(record["layers"][-1], prefix=f"model.layers.{done}."))
        record["layers_done"] = done + 1
        (work / f"acts-{done}.safetensors").rename(work / f"acts-{done + 1}.safetensors")

    _edit_record(work, skip_layer)
    out = _export(site / "src", site / "out")
    _same_export(site / "ref", out)
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert {n.split(".")[2] for n in names if n.startswith("model.layers.")} == set("0123")


def test_a_record_naming_a_file_outside_the_work_area_never_moves_it(site: Path) -> None:
    victim = site / "victim.safetensors"
    victim.write_bytes(b"a private file of another user")
    victim.chmod(0o600)
    work = _the_work_dir(site / "out")
    _edit_record(work, lambda r: r["writer"]["shards"][0].__setitem__(0, "../victim.safetensors"))
    out = _export(site / "src", site / "out")
    assert victim.read_bytes() == b"a private file of another user"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert all(p.read_bytes() != victim.read_bytes() for p in out.iterdir())
    _same_export(site / "ref", out)


def test_a_record_listing_a_model_shard_as_pending_never_deletes_it(site: Path) -> None:
    shard = sorted((site / "src").glob("model-*.safetensors"))[0]
    original = shard.read_bytes()
    work = _the_work_dir(site / "out")

    def plant(record: dict[str, Any]) -> None:
        pending = record["writer"]["pending"]
        width = len(pending[0]) if pending else 2
        pending.append([f"../src/{shard.name}", [], "0" * 64][:width])

    _edit_record(work, plant)
    out = _export(site / "src", site / "out")
    assert shard.read_bytes() == original
    _same_export(site / "ref", out)


def test_a_signed_record_that_skips_a_layer_is_refused_before_publishing(site: Path) -> None:
    # Defence in depth: the record verifies (re-signed here as only exportlm could), its
    # files too, yet the checkpoint lacks layer 1: nothing may be published.
    from exportlm.export.hf_checkpoint.stream._record import save_record

    work = _the_work_dir(site / "out")
    record = json.loads((work / "progress.json").read_text())["record"]
    done = record["layers_done"]  # layers 0 and 1; claim layer 2 too, without writing it
    record["layers"].append(dict(record["layers"][-1], prefix=f"model.layers.{done}."))
    record["layers_done"] = done + 1
    (work / f"acts-{done}.safetensors").rename(work / f"acts-{done + 1}.safetensors")
    save_record(work, record)
    with pytest.raises(StreamIntegrityError, match=r"model\.layers\.2\."):
        _export(site / "src", site / "out")
    assert not (site / "out").exists()
    assert _work_dirs(site / "out") == []  # removed: the next run starts afresh
    _same_export(site / "ref", _export(site / "src", site / "out"))


# ----------------------------------------------------------------- planted bytes


def _doubled(path: Path) -> None:
    """Rewrite the safetensors file ``path`` with every float tensor doubled (still valid)."""
    tensors = load_file(path)
    for name, tensor in tensors.items():
        if tensor.dtype in (torch.bfloat16, torch.float16, torch.float32):
            tensors[name] = tensor * 2
        elif tensor.dtype == torch.float8_e4m3fn:
            tensors[name] = (tensor.float() / 2).to(tensor.dtype)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("kind", ["shard-", "pending-", "acts-"])
def test_work_files_changed_after_they_were_written_are_never_published(
    site: Path, kind: str
) -> None:
    work = _the_work_dir(site / "out")
    planted = sorted(p for p in work.iterdir() if kind in p.name)
    assert planted, sorted(p.name for p in work.iterdir())
    for path in planted:
        _doubled(path)
    out = _export(site / "src", site / "out")
    _same_export(site / "ref", out)


# ----------------------------------------------------------------- special files


def test_a_fifo_as_the_progress_record_neither_hangs_nor_stops_the_export(site: Path) -> None:
    for work in _work_dirs(site / "out"):
        (work / "progress.json").unlink()
        os.mkfifo(work / "progress.json")
    script = "import sys; from exportlm.stream import export_streaming; " + (
        "export_streaming(sys.argv[1], sys.argv[2], recipe='fp8', max_shard_size='100KB')"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", script, str(site / "src"), str(site / "out")],
            capture_output=True,
            text=True,
            timeout=240,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the export blocked on the FIFO")
    assert done.returncode == 0, done.stderr[-2000:]
    _same_export(site / "ref", site / "out")


# ----------------------------------------------------------------- shared directories


def _foreign(path: Path) -> None:
    """Make ``path`` (and what is in it) another user's, as far as this process can."""
    if os.getuid() == 0:
        for p in [path, *path.rglob("*")]:
            os.lchown(p, 65534, 65534)
    else:
        path.chmod(0o555)  # not removable by us, as another user's would be


def _plant(site: Path, kind: str) -> Path:
    victim = site / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("the victim's")
    if kind == "stream_dir":
        planted = site / ".out.stream"
        planted.mkdir()
        (planted / "progress.json").write_text("{}")
        _foreign(planted)
    elif kind == "stream_link":
        planted = site / ".out.stream"
        planted.symlink_to(victim)
    elif kind == "work_link":
        planted = site / ".out.stream-planted"
        planted.symlink_to(victim)
    else:
        planted = site / ".out.planted.tmp"
        planted.mkdir()
        (planted / "payload").write_text("theirs")
        old = time.time() - 3600  # a dead writer's, by its age
        os.utime(planted, (old, old))
        _foreign(planted)
    return planted


def _snapshot(path: Path) -> list[tuple[str, int, bytes]]:
    entries = [path, *path.rglob("*")] if path.is_dir() and not path.is_symlink() else [path]
    return [
        (str(p), os.lstat(p).st_uid, p.read_bytes() if p.is_file() and not p.is_symlink() else b"")
        for p in entries
    ]


@pytest.mark.parametrize("kind", ["stream_dir", "stream_link", "staging_dir", "work_link"])
def test_entries_planted_beside_the_output_are_ignored_never_followed_or_deleted(
    tmp_path: Path, kind: str
) -> None:
    src = llama_directory(tmp_path, tied=False, layers=2)
    expected = _export(src, tmp_path / "ref")
    planted = _plant(tmp_path, kind)
    before, victim = _snapshot(planted), _snapshot(tmp_path / "victim")
    try:
        _same_export(expected, _export(src, tmp_path / "out"))
        assert _snapshot(planted) == before
        assert _snapshot(tmp_path / "victim") == victim
    finally:
        if planted.exists() and not planted.is_symlink():
            planted.chmod(0o755)  # for pytest's clean-up (a non-root run made it 0555)
