"""Fuzzing ``inspect_checkpoint`` and the ``hf_checkpoint`` loader with mutated checkpoints.

Each example mutates one copy of a valid FP8 Llama export (no manifest, so only the
readers' own checks stand between the bytes and the model) and holds both readers to:

* **only exportlm's errors**: anything else raised (a ``TypeError``, a
  ``SafetensorError``, a ``KeyError``) fails the example;
* **no hang**: every call runs under a ``SIGALRM`` watchdog that fails the example
  after :data:`WATCHDOG_S` seconds (a call normally takes 0.05 s);
* **never a silent success where it is detectable**: a one-field edit of a
  safetensors header, or any edit of the index, either is refused by the loader or
  loads exactly the original logits (a header edit that keeps the bytes valid, e.g.
  ``[]`` -> ``[1]`` for a scale, may load); a NaN, infinite, zero or negative scale is
  refused by the loader and is an error-level finding of ``inspect``. Flipping tensor
  data bytes without a manifest is undetectable by design (the manifest's sha256 is
  what catches it), so it is not claimed.

Deterministic: ``derandomize=True`` and no example database, so CI replays the same
examples; ``max_examples=20`` per fuzzer keeps the file near 10 s on one core.
"""

from __future__ import annotations

import contextlib
import json
import signal
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import exportlm
from exportlm.errors import ExportLMError
from exportlm.export.guard import UnverifiedArtifactWarning
from exportlm.inspection import inspect_checkpoint
from tests._malformed import (
    INDEX,
    SHARD,
    copy_base,
    edit_tensors,
    export_bases,
    join_shard,
    split_shard,
)

WATCHDOG_S = 10
IDS = torch.tensor([[1, 5, 9, 200, 3]])
FUZZ = settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class Hang(BaseException):
    """A call outlived the watchdog (a ``BaseException``, so no ``except Exception`` eats it)."""


@contextlib.contextmanager
def watchdog(seconds: int = WATCHDOG_S) -> Iterator[None]:
    def fire(signum: int, frame: FrameType | None) -> None:
        raise Hang(f"the call did not return within {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def inspect_ok(directory: Path) -> bool:
    """``inspect_checkpoint(directory).ok``; an exportlm error counts as not ok."""
    with watchdog():
        try:
            return inspect_checkpoint(directory).ok
        except ExportLMError:
            return False


def load_logits(directory: Path) -> torch.Tensor | None:
    """The loaded checkpoint's logits on :data:`IDS`, ``None`` when refused with an exportlm error."""
    with watchdog(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UnverifiedArtifactWarning)
        try:
            run = exportlm.load_exported("hf_checkpoint", directory)
        except ExportLMError:
            return None
        with torch.no_grad():
            logits: torch.Tensor = run(IDS)
        return logits


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return export_bases(tmp_path_factory.mktemp("fuzz-bases"))


@pytest.fixture(scope="module")
def reference(bases: dict[str, Path]) -> torch.Tensor:
    logits = load_logits(bases["single"])
    assert logits is not None
    return logits


@contextlib.contextmanager
def mutated(base: Path, mutate: Callable[[Path], object]) -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        directory = copy_base(base, Path(tmp) / "ckpt")
        mutate(directory)
        yield directory


# ----------------------------------------------------------------------------- strategies

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["F32", "F8_E4M3", "I32", "U8", "F99", "model.safetensors", "../x", "/etc"]),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
HEADER_FIELDS = st.sampled_from(["dtype", "shape", "data_offsets", "<entry>", "<name>"])


def _set_header_field(header: dict[str, Any], name: str, field: str, value: Any) -> None:
    if field == "<entry>":
        header[name] = value
    elif field == "<name>":
        header[str(value)] = header.pop(name)
    else:
        header[name][field] = value


# ----------------------------------------------------------------------------- the fuzzers


@FUZZ
@given(data=st.data(), field=HEADER_FIELDS, value=JSON_VALUES)
def test_header_field_edits_are_refused_or_load_the_original(
    bases: dict[str, Path], reference: torch.Tensor, data: st.DataObject, field: str, value: Any
) -> None:
    header, body = split_shard((bases["single"] / SHARD).read_bytes())
    name = data.draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
    _set_header_field(header, name, field, value)
    shard_bytes = join_shard(header, body)

    with mutated(bases["single"], lambda d: (d / SHARD).write_bytes(shard_bytes)) as directory:
        inspect_ok(directory)
        logits = load_logits(directory)
    assert logits is None or torch.equal(logits, reference), (name, field, value)


@FUZZ
@given(data=st.data(), byte=st.integers(0, 255))
def test_header_byte_flips_are_refused_or_load_the_original(
    bases: dict[str, Path], reference: torch.Tensor, data: st.DataObject, byte: int
) -> None:
    raw = bytearray((bases["single"] / SHARD).read_bytes())
    header_end = 8 + int.from_bytes(raw[:8], "little")
    position = data.draw(st.integers(min_value=0, max_value=header_end - 1))
    raw[position] = byte

    with mutated(bases["single"], lambda d: (d / SHARD).write_bytes(bytes(raw))) as directory:
        inspect_ok(directory)
        logits = load_logits(directory)
    assert logits is None or torch.equal(logits, reference), (position, byte)


@FUZZ
@given(data=st.data(), value=JSON_VALUES, where=st.sampled_from(["value", "key", "map", "index"]))
def test_index_edits_are_refused_or_load_the_original(
    bases: dict[str, Path], reference: torch.Tensor, data: st.DataObject, value: Any, where: str
) -> None:
    index = json.loads((bases["sharded"] / INDEX).read_text())
    tensor = data.draw(st.sampled_from(sorted(index["weight_map"])))
    if where == "value":
        index["weight_map"][tensor] = value
    elif where == "key":
        index["weight_map"][str(value)] = index["weight_map"].pop(tensor)
    elif where == "map":
        index["weight_map"] = value
    else:
        index = value
    text = json.dumps(index)

    with mutated(bases["sharded"], lambda d: (d / INDEX).write_text(text)) as directory:
        inspect_ok(directory)
        logits = load_logits(directory)
    assert logits is None or torch.equal(logits, reference), (where, tensor, value)


@FUZZ
@given(
    file=st.sampled_from(["config.json", "hf_quant_config.json"]),
    key=st.sampled_from(
        ["architectures", "hidden_size", "vocab_size", "num_attention_heads", "model_type",
         "quantization_config", "quantization", "rms_norm_eps", "auto_map", "head_dim", "dtype"]
    ),
    value=JSON_VALUES,
    garbage=st.one_of(st.none(), st.binary(max_size=40)),
)  # fmt: skip
def test_config_edits_raise_only_exportlm_errors(
    bases: dict[str, Path], file: str, key: str, value: Any, garbage: bytes | None
) -> None:
    def mutate(directory: Path) -> None:
        path = directory / file
        if garbage is not None:
            path.write_bytes(garbage)
            return
        config = json.loads(path.read_text())
        config[key] = value
        path.write_text(json.dumps(config))

    with mutated(bases["single"], mutate) as directory:
        inspect_ok(directory)
        load_logits(directory)  # any outcome but a foreign exception or a hang


SCALES = [
    "model.layers.0.self_attn.q_proj.weight_scale",
    "model.layers.1.mlp.down_proj.input_scale",
    "model.layers.0.mlp.up_proj.weight_scale",
]


@FUZZ
@given(
    name=st.sampled_from(SCALES),
    value=st.sampled_from([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, -1e-3, -7.0]),
)
def test_an_unusable_scale_is_always_refused_and_reported(
    bases: dict[str, Path], name: str, value: float
) -> None:
    def mutate(directory: Path) -> None:
        edit_tensors(
            directory / SHARD, lambda t: t.__setitem__(name, torch.full_like(t[name], value))
        )

    with mutated(bases["single"], mutate) as directory:
        assert not inspect_ok(directory), (name, value)
        assert load_logits(directory) is None, (name, value)


def test_the_fuzzers_start_from_a_checkpoint_both_accept(
    bases: dict[str, Path], reference: torch.Tensor
) -> None:
    for base in bases.values():
        assert inspect_ok(base)
    assert torch.isfinite(reference).all()
