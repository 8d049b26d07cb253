"""All-or-nothing writes (``exportlm.atomic``): a reader sees the old content or the new."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from exportlm.atomic import (
    atomic_output,
    replace_directory,
    write_bytes_atomic,
    write_text_atomic,
)
from exportlm.errors import OutputExistsError


class _Boom(Exception):
    pass


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_write_text_creates_parents_and_replaces(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "golden.json"
    write_text_atomic(target, "first\n")
    write_text_atomic(target, "second ✓\n")
    assert target.read_bytes() == "second ✓\n".encode()
    assert _listing(target.parent) == ["golden.json"]  # no temporary left behind


def test_write_bytes_keeps_bytes_exactly(tmp_path: Path) -> None:
    data = bytes(range(256)) + b"\r\n\n"
    write_bytes_atomic(tmp_path / "blob.bin", data)
    assert (tmp_path / "blob.bin").read_bytes() == data


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    target.write_text("old")
    with pytest.raises(TypeError):
        write_bytes_atomic(target, "not bytes")  # type: ignore[arg-type]
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(target, "\udcff", encoding="utf-8")
    assert target.read_text() == "old"
    assert _listing(tmp_path) == ["report.json"]


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
def test_written_file_mode_follows_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o027)
    try:
        write_text_atomic(tmp_path / "f.txt", "x")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "f.txt").stat().st_mode) == 0o640


def test_replace_directory_swaps_in_the_new_tree(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "old.safetensors").write_text("old")
    new = tmp_path / ".ckpt.staged"
    new.mkdir()
    (new / "model.safetensors").write_text("new")
    replace_directory(new, target)
    assert _listing(target) == ["model.safetensors"]
    assert _listing(tmp_path) == ["ckpt"]  # neither the staged nor the old tree is left


def test_replace_directory_over_a_file(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.write_text("a file")
    new = tmp_path / "staged"
    new.mkdir()
    replace_directory(new, target)
    assert target.is_dir()


def test_atomic_output_file_publishes_data_before_the_artifact(tmp_path: Path) -> None:
    target = tmp_path / "m.onnx"
    with atomic_output(target) as staged:
        staged.write_text("graph")
        (staged.parent / "m.onnx.data").write_text("weights")
        assert not target.exists()
    assert _listing(tmp_path) == ["m.onnx", "m.onnx.data"]


def test_atomic_output_failure_keeps_the_previous_artifact(tmp_path: Path) -> None:
    target = tmp_path / "m.pt"
    target.write_text("previous")

    def half_written() -> None:
        with atomic_output(target) as staged:
            staged.write_text("half")
            raise _Boom

    with pytest.raises(_Boom):
        half_written()
    assert target.read_text() == "previous"
    assert _listing(tmp_path) == ["m.pt"]


def test_atomic_output_directory_refuses_a_non_empty_directory_unless_overwrite(
    tmp_path: Path,
) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "keep").write_text("keep")
    with (
        pytest.raises(OutputExistsError, match="overwrite=True"),
        atomic_output(target, directory=True, overwrite=False),
    ):
        pass
    with atomic_output(target, directory=True) as staged:
        (staged / "config.json").write_text("{}")
    assert _listing(target) == ["config.json"]


def _modes(root: Path) -> dict[str, int]:
    """``{relative path: permission bits}`` of ``root`` (``"."``) and everything under it."""
    paths = [root, *sorted(root.rglob("*"))]
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in paths}


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
@pytest.mark.parametrize(
    ("umask", "directory", "file"), [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)]
)
def test_a_published_directory_gets_the_umask_modes_not_the_staging_ones(
    tmp_path: Path, umask: int, directory: int, file: int
) -> None:
    previous = os.umask(umask)
    try:
        with atomic_output(tmp_path / "ckpt", directory=True) as staged:
            assert stat.S_IMODE(staged.stat().st_mode) == 0o700  # mkdtemp: private while staged
            (staged / "config.json").write_text("{}")
            fd, private = tempfile.mkstemp(dir=staged)  # a writer's own 0600 temporary
            os.close(fd)
            (staged / "shards").mkdir(mode=0o700)
            (staged / "shards" / "model.safetensors").write_bytes(b"\0")
    finally:
        os.umask(previous)
    name = Path(private).name
    assert _modes(tmp_path / "ckpt") == {
        ".": directory,
        "config.json": file,
        name: file,
        "shards": directory,
        "shards/model.safetensors": file,
    }


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
def test_replace_directory_publishes_a_mkdtemp_directory_with_the_umask_modes(
    tmp_path: Path,
) -> None:
    staged = Path(tempfile.mkdtemp(dir=tmp_path))
    (staged / "model.safetensors").write_bytes(b"\0")
    previous = os.umask(0o022)
    try:
        replace_directory(staged, tmp_path / "ckpt")
    finally:
        os.umask(previous)
    assert _modes(tmp_path / "ckpt") == {".": 0o755, "model.safetensors": 0o644}
