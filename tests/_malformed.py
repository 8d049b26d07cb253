"""Malformed checkpoints made by mutating a valid exported one: the cases both ``exportlm
inspect`` (``tests/test_inspect_malformed.py``) and the ``hf_checkpoint`` loader
(``tests/test_loader_malformed.py``) must refuse, and the byte-level editors the
fuzzer (``tests/test_fuzz_checkpoint.py``) shares.

Each case names the file it breaks, the ``inspect`` rule that must fail, and the
exportlm error the loader must raise. Cases drop the manifest (so the loader's own
validation, not the manifest's hash, is what refuses), except ``*-with-manifest``.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

import exportlm
from exportlm.errors import (
    CustomCodeRefusedError,
    ExportLMError,
    MalformedCheckpointError,
    UnknownQuantAlgoError,
)
from exportlm.models import build_model
from exportlm.quant import quantize

SHARD = "model.safetensors"
INDEX = "model.safetensors.index.json"
MANIFEST = "exportlm-manifest.json"
Q_PROJ = "model.layers.0.self_attn.q_proj"


def export_bases(root: Path) -> dict[str, Path]:
    """A single-file and a sharded FP8 (static inputs) Llama checkpoint under ``root``."""
    model = quantize(build_model("llama", seed=0), "fp8")
    single = exportlm.export_model("hf_checkpoint", model, root / "single")
    sharded = exportlm.export_model("hf_checkpoint", model, root / "sharded", max_shard_size=60_000)
    return {"single": Path(single), "sharded": Path(sharded)}


def copy_base(base: Path, to: Path, *, keep_manifest: bool = False) -> Path:
    shutil.copytree(base, to)
    if not keep_manifest:
        (to / MANIFEST).unlink()
    return to


# ----------------------------------------------------------------------------- editors


def split_shard(data: bytes) -> tuple[dict[str, Any], bytes]:
    """``(header, data section)`` of a shard's bytes."""
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def join_shard(header: Any, body: bytes) -> bytes:
    """A shard's bytes from a header (any JSON value) and a data section."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header with spaces
    return struct.pack("<Q", len(raw)) + raw + body


def edit_header(path: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    """Rewrite ``path``'s header through ``edit`` (which may return a replacement)."""
    header, body = split_shard(path.read_bytes())
    replaced = edit(header)
    path.write_bytes(join_shard(header if replaced is None else replaced, body))


def edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def edit_json(path: Path, edit: Callable[[Any], Any]) -> None:
    data = json.loads(path.read_text())
    replaced = edit(data)
    path.write_text(json.dumps(data if replaced is None else replaced))


def _set_entry(tensor: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda header: header[tensor].update(fields)


def _first_shard(directory: Path) -> Path:
    return sorted(directory.glob("model-*.safetensors"))[0]


def _index_entry(directory: Path, value: Any) -> None:
    edit_json(directory / INDEX, lambda d: d["weight_map"].__setitem__(f"{Q_PROJ}.weight", value))


# ----------------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class Case:
    """One malformed checkpoint.

    Attributes:
        base: ``"single"`` or ``"sharded"``.
        mutate: breaks the copied directory in place.
        rule: the error-level ``inspect`` rule that must fail.
        file: the file the finding and the loader's error must name.
        error: the exportlm error the loader raises.
        keep_manifest: keep ``exportlm-manifest.json`` (the manifest refuses first).
    """

    base: str
    mutate: Callable[[Path], object]
    rule: str
    file: str
    error: type[ExportLMError] = MalformedCheckpointError
    keep_manifest: bool = False


def _header(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Path], object]:
    return lambda d: edit_header(d / SHARD, edit)


def _raw(edit: Callable[[bytes], bytes]) -> Callable[[Path], object]:
    return lambda d: (d / SHARD).write_bytes(edit((d / SHARD).read_bytes()))


def _overlap(header: dict[str, Any]) -> None:
    # embed_tokens moves onto lm_head's bytes; its own bytes become a gap
    header["model.embed_tokens.weight"]["data_offsets"] = header["lm_head.weight"]["data_offsets"]


def _tensor(name: str, value: float) -> Callable[[Path], object]:
    return lambda d: edit_tensors(
        d / SHARD, lambda t: t.__setitem__(name, torch.full_like(t[name], value))
    )


def _drop_layer(index: int) -> Callable[[Path], object]:
    """Every tensor of decoder layer ``index`` removed (a shard or a resumed layer lost)."""

    def drop(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n in tensors if n.startswith(f"model.layers.{index}.")]:
            del tensors[name]

    return lambda d: edit_tensors(d / SHARD, drop)


def _outside(d: Path) -> None:
    # a valid shard outside the checkpoint: without the check the loader would read it
    shutil.copy(_first_shard(d), d.parent / "outside.safetensors")
    _index_entry(d, "../outside.safetensors")


CASES: dict[str, Case] = {
    "config-garbage-bytes": Case(
        "single",
        lambda d: (d / "config.json").write_bytes(bytes(range(256)) * 4),
        "config-unreadable",
        "config.json",
    ),
    "config-json-list": Case(
        "single",
        lambda d: (d / "config.json").write_text("[1, 2]"),
        "config-unreadable",
        "config.json",
    ),
    "config-missing": Case(
        "single", lambda d: (d / "config.json").unlink(), "config-unreadable", "config.json"
    ),
    "architectures-5": Case(
        "single",
        lambda d: edit_json(d / "config.json", lambda c: c.update(architectures=5)),
        "config-field-invalid",
        "config.json",
    ),
    "hidden-size-negative": Case(
        "single",
        lambda d: edit_json(d / "config.json", lambda c: c.update(hidden_size=-4)),
        "config-field-invalid",
        "config.json",
    ),
    "config-dtype-list": Case(  # found by the fuzzer: transformers raised IndexError
        "single",
        lambda d: edit_json(d / "config.json", lambda c: c.update(dtype=[])),
        "config-field-invalid",
        "config.json",
    ),
    "config-dtype-unknown": Case(  # transformers: AttributeError: no attribute 'float99'
        "single",
        lambda d: edit_json(d / "config.json", lambda c: c.update(dtype="float99")),
        "config-field-invalid",
        "config.json",
    ),
    "auto-map": Case(
        "single",
        lambda d: edit_json(
            d / "config.json", lambda c: c.update(auto_map={"AutoConfig": "evil.EvilConfig"})
        ),
        "custom-code",
        "config.json",
        CustomCodeRefusedError,
    ),
    "index-not-object": Case(
        "sharded", lambda d: (d / INDEX).write_text('["weight_map"]'), "index-unreadable", INDEX
    ),
    "index-weight-map-list": Case(
        "sharded",
        lambda d: edit_json(d / INDEX, lambda i: i.update(weight_map=list(i["weight_map"]))),
        "index-unreadable",
        INDEX,
    ),
    "index-missing-file": Case(
        "sharded",
        lambda d: _index_entry(d, "model-00099-of-00099.safetensors"),
        "index-mismatch",
        "model-00099-of-00099.safetensors",
    ),
    "index-absolute-path": Case(
        "sharded", lambda d: _index_entry(d, "/etc/hostname"), "index-path-escapes", INDEX
    ),
    "index-dotdot": Case("sharded", _outside, "index-path-escapes", INDEX),
    "header-length-beyond-file": Case(
        "single",
        _raw(lambda b: struct.pack("<Q", len(b) * 2) + b[8:]),
        "shard-unreadable",
        SHARD,
    ),
    "header-not-json": Case(
        "single",
        _raw(lambda b: b[:8] + b"\xff{not json" + b[19:]),
        "shard-unreadable",
        SHARD,
    ),
    "header-not-object": Case("single", _header(lambda h: [list(h)]), "shard-unreadable", SHARD),
    "dtype-f99": Case(
        "single", _header(_set_entry("lm_head.weight", dtype="F99")), "shard-dtype-unknown", SHARD
    ),
    "shape-not-list": Case(
        "single", _header(_set_entry("lm_head.weight", shape=5)), "shard-tensor-malformed", SHARD
    ),
    "shape-negative": Case(
        "single",
        _header(_set_entry("lm_head.weight", shape=[-256, -128])),
        "shard-tensor-malformed",
        SHARD,
    ),
    "offsets-overlapping": Case("single", _header(_overlap), "shard-byte-ranges", SHARD),
    "offsets-beyond-file": Case(
        "single", _raw(lambda b: b[: len(b) - 100]), "shard-unreadable", SHARD
    ),
    "nan-weight-scale": Case(
        "single", _tensor(f"{Q_PROJ}.weight_scale", float("nan")), "scale-nonfinite", SHARD
    ),
    "inf-input-scale": Case(
        "single", _tensor(f"{Q_PROJ}.input_scale", float("inf")), "scale-nonfinite", SHARD
    ),
    "zero-weight-scale": Case(
        "single", _tensor(f"{Q_PROJ}.weight_scale", 0.0), "scale-nonpositive", SHARD
    ),
    "quant-algo-unknown": Case(
        "single",
        lambda d: edit_json(
            d / "config.json", lambda c: c["quantization_config"].update(quant_algo="FP9")
        ),
        "quant-algo-unknown",
        "config.json",
        UnknownQuantAlgoError,
    ),
    "layer-1-missing": Case("single", _drop_layer(1), "layer-missing", "config.json"),
    "text-config-empty": Case(  # transformers raised AttributeError building the model
        "single",
        lambda d: edit_json(d / "config.json", lambda c: c.__setitem__("text_config", {})),
        "config-field-invalid",
        "config.json",
    ),
    "hf-quant-config-garbage": Case(
        "single",
        lambda d: (d / "hf_quant_config.json").write_bytes(b"\x00\x01garbage\x9c"),
        "config-unreadable",
        "hf_quant_config.json",
    ),
}

#: The manifest still refuses a corrupted checkpoint first (``ArtifactIntegrityError``).
MANIFEST_CASES: dict[str, str] = {"nan-weight-scale-with-manifest": "nan-weight-scale"}
