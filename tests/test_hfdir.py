"""``exportlm.hfdir.shard_name_problem``: the one confinement rule for the shards an index names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exportlm.errors import MalformedCheckpointError
from exportlm.hfdir import shard_name_problem, vet_model_directory


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("", "is not a file name"),
        ("..", "is not a file name"),
        ("/etc/passwd", "is an absolute path"),
        ("C:\\x.safetensors", "is an absolute path"),
        ("../../dev/zero", "climbs out of the directory"),
        ("sub/model.safetensors", "is a path, not a plain file name"),
    ],
)
def test_a_shard_name_that_is_no_file_of_the_directory_is_refused(
    tmp_path: Path, name: str, why: str
) -> None:
    problem = shard_name_problem(tmp_path, name)
    assert problem is not None
    assert why in problem


def test_a_plain_name_and_a_link_inside_pass_a_link_outside_does_not(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert shard_name_problem(tmp_path, "model.safetensors") is None
    assert shard_name_problem(tmp_path, "missing.safetensors") is None  # absent is not escape
    (tmp_path / "inside.safetensors").symlink_to(tmp_path / "model.safetensors")
    assert shard_name_problem(tmp_path, "inside.safetensors") is None
    outside = tmp_path.parent / f"{tmp_path.name}-outside.safetensors"
    outside.write_bytes(b"")
    (tmp_path / "out.safetensors").symlink_to(outside)
    problem = shard_name_problem(tmp_path, "out.safetensors")
    assert problem is not None
    assert "symbolic link" in problem


def test_vet_model_directory_applies_the_same_rule(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    index = {"weight_map": {"w": "sub/model-00001-of-00001.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MalformedCheckpointError, match="is a path, not a plain file name"):
        vet_model_directory(tmp_path)
