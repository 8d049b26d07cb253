"""The ``hf_checkpoint`` loader refuses every malformed checkpoint of ``tests/_malformed.py``
with an exportlm error naming the file, never a dependency's exception; it never reads a
file outside the checkpoint, never runs or prompts for the checkpoint's code, and never
blocks on a FIFO."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import exportlm
from exportlm.errors import (
    ArtifactIntegrityError,
    CustomCodeRefusedError,
    MalformedCheckpointError,
    NotRegularFileError,
)
from exportlm.export.guard import UnverifiedArtifactWarning
from tests._malformed import (
    CASES,
    INDEX,
    MANIFEST_CASES,
    Q_PROJ,
    SHARD,
    copy_base,
    edit_json,
    export_bases,
)

TARGET = "hf_checkpoint"


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return export_bases(tmp_path_factory.mktemp("bases"))


def load(directory: Path) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnverifiedArtifactWarning)
        return exportlm.load_exported(TARGET, directory)


@pytest.mark.parametrize("base", ["single", "sharded"])
def test_the_bases_load_without_their_manifest(
    bases: dict[str, Path], base: str, tmp_path: Path
) -> None:
    run = load(copy_base(bases[base], tmp_path / "ckpt"))
    assert torch.isfinite(run(torch.tensor([[1, 2, 3]]))).all()


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_malformed_checkpoint_is_an_exportlm_error_naming_the_file(
    case: str, bases: dict[str, Path], tmp_path: Path
) -> None:
    spec = CASES[case]
    directory = copy_base(bases[spec.base], tmp_path / "ckpt")
    spec.mutate(directory)
    with pytest.raises(spec.error) as caught:
        load(directory)
    assert type(caught.value) is spec.error, repr(caught.value)  # not a subclass or a wrapper
    assert spec.file in str(caught.value), str(caught.value)
    if isinstance(caught.value, MalformedCheckpointError):
        assert caught.value.path is not None  # the file, for callers that act on it


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_with_its_manifest_the_corruption_is_refused_by_the_manifest(
    case: str, bases: dict[str, Path], tmp_path: Path
) -> None:
    spec = CASES[MANIFEST_CASES[case]]
    directory = copy_base(bases[spec.base], tmp_path / "ckpt", keep_manifest=True)
    spec.mutate(directory)
    with pytest.raises(ArtifactIntegrityError, match=SHARD):
        exportlm.load_exported(TARGET, directory)


@pytest.mark.parametrize(
    ("case", "tensor"),
    [("nan-weight-scale", f"{Q_PROJ}.weight_scale"), ("inf-input-scale", f"{Q_PROJ}.input_scale")],
)
def test_a_non_finite_scale_is_refused_naming_the_tensor(
    case: str, tensor: str, bases: dict[str, Path], tmp_path: Path
) -> None:
    directory = copy_base(bases["single"], tmp_path / "ckpt")
    CASES[case].mutate(directory)
    with pytest.raises(MalformedCheckpointError, match="NaN / infinite") as caught:
        load(directory)
    assert caught.value.field == tensor
    assert tensor in str(caught.value)


def test_a_header_defect_names_the_tensor(bases: dict[str, Path], tmp_path: Path) -> None:
    directory = copy_base(bases["single"], tmp_path / "ckpt")
    CASES["dtype-f99"].mutate(directory)
    with pytest.raises(MalformedCheckpointError, match="'F99'") as caught:
        load(directory)
    assert caught.value.field == "lm_head.weight"
    assert caught.value.path == directory / SHARD


def test_a_shard_linked_from_outside_is_not_read(bases: dict[str, Path], tmp_path: Path) -> None:
    directory = copy_base(bases["sharded"], tmp_path / "ckpt")
    shard = sorted(directory.glob("model-*.safetensors"))[0]
    outside = tmp_path / "elsewhere.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)
    with pytest.raises(MalformedCheckpointError, match="outside") as caught:
        load(directory)
    assert caught.value.path == directory / INDEX


@pytest.mark.parametrize("name", [SHARD, "config.json", "hf_quant_config.json"])
def test_a_fifo_is_refused_not_waited_on(name: str, bases: dict[str, Path], tmp_path: Path) -> None:
    directory = copy_base(bases["single"], tmp_path / "ckpt")
    (directory / name).unlink()
    os.mkfifo(directory / name)
    with pytest.raises(NotRegularFileError, match=re.escape(name)):
        load(directory)


def test_custom_code_is_refused_before_transformers_reads_the_directory(
    bases: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("transformers was asked to read a directory with custom code")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", never)
    monkeypatch.setattr("sys.stdin", None)  # a prompt would fail loudly, not hang
    directory = copy_base(bases["single"], tmp_path / "ckpt")
    (directory / "modeling_evil.py").write_text("raise SystemExit('ran the checkpoint code')\n")
    with pytest.raises(CustomCodeRefusedError, match=r"modeling_evil\.py"):
        load(directory)


def test_transformers_is_asked_never_to_trust_remote_code(
    bases: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    seen: list[Any] = []
    original = transformers.AutoConfig.from_pretrained

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("trust_remote_code", "unset"))
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", spy)
    load(copy_base(bases["single"], tmp_path / "ckpt"))
    assert seen == [False]


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("num_hidden_layers", 100_000, "num_hidden_layers is 100000"),  # hung building 1e5 layers
        ("hidden_size", 2**40, r"has shape \[256, 128\]"),
        ("num_attention_heads", 64, "self_attn.o_proj.weight has shape"),
    ],
)
def test_config_sizes_the_tensors_contradict_are_refused_before_a_model_is_built(
    field: str, value: int, match: str, bases: dict[str, Path], tmp_path: Path
) -> None:
    directory = copy_base(bases["single"], tmp_path / "ckpt")
    edit_json(directory / "config.json", lambda c: c.update({field: value}))
    with pytest.raises(MalformedCheckpointError, match=match) as caught:
        load(directory)
    assert caught.value.field is not None
