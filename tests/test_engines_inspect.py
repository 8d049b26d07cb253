"""``exportlm inspect`` never says an engine loads what that engine's support table refuses.

One case per checkpoint row of the built-in engines' support tables
(:mod:`exportlm.engines.builtin`) that this machine can write: the checkpoint is
exported with that layout and scheme (checked with :func:`~exportlm.engines.artifact_kind`),
inspected, and inspect's loader list is held against the row:

* ``refused`` / ``misreads``: inspect never lists the engine as loading it;
* ``runs`` here (measured by ``make test-engines``): inspect lists it and reports no refusal;
* ``runs`` on a GPU only: the row is read from the engine's source (``-gpu-source`` in
  the id); inspect may list it, and never says the engine refuses it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

import exportlm
from exportlm.engines import Support, Verdict, artifact_kind, get_engine
from exportlm.inspection import inspect_checkpoint
from exportlm.models import build_model
from exportlm.quant import quantize

#: (layout, scheme) -> (export format, recipe, quantize's exclude): what writes it.
WRITERS: dict[tuple[str | None, str | None], tuple[str | None, str | None, tuple[str, ...]]] = {
    (None, None): (None, None, ()),
    ("modelopt", "FP8"): ("modelopt", "fp8", ()),
    ("modelopt", "NVFP4"): ("modelopt", "nvfp4", ()),
    ("modelopt", "W8A16"): ("modelopt", "int8_wo", ()),
    ("modelopt", "W8A8_SQ_PER_CHANNEL"): ("modelopt", "int8_sq", ()),
    ("modelopt", "W4A16_AWQ"): ("modelopt", "int4_awq", ()),
    ("compressed-tensors", "FP8"): ("compressed-tensors", "fp8", ()),
    ("compressed-tensors", "NVFP4"): ("compressed-tensors", "nvfp4", ()),
    ("compressed-tensors", "W8A8"): ("compressed-tensors", "w8a8", ()),
    ("compressed-tensors", "W8A16"): ("compressed-tensors", "int8_wo", ()),
    # compressed-tensors has no pre_quant_scale: AWQ's scale must fold into a norm
    # compressed-tensors' convention: every linear and expert (the scales fold into the op before)
    ("compressed-tensors", "W4A16"): (
        "compressed-tensors",
        "int4_awq:scales=compressed-tensors",
        (),
    ),
    ("modelopt", "MXFP8"): ("modelopt", "mxfp8", ()),
    ("modelopt", "mxfp4"): ("modelopt", "mxfp4", ()),
    ("compressed-tensors", "MXFP4A16"): ("compressed-tensors", "mxfp4", ()),
    ("compressed-tensors", "MXFP8"): ("compressed-tensors", "mxfp8", ()),
    # tiles of 32: compressed-tensors 0.17 reads a weight one 128-tile wide as per-channel
    ("compressed-tensors", "FP8_BLOCK"): ("compressed-tensors", "fp8_block:group_size=32", ()),
    ("modelopt", "W4A8_AWQ"): ("modelopt", "w4a8_awq", ()),
    ("fp8", "FP8_BLOCK"): ("finegrained-fp8", "fp8_block:group_size=32", ()),
    ("compressed-tensors", "W4AFP8"): ("compressed-tensors", "w4afp8", ()),
    # gpt-oss's layout quantizes the experts only
    ("mxfp4", "MXFP4"): ("gpt-oss-mxfp4", "mxfp4", ("*self_attn*",)),
    # q / k / v left float: the toy's 64-row k_proj would split vLLM's fused qkv_proj in
    # tiles of 128 (fp8-block-fused-rows: its loader fails)
    ("modelopt", "fp8_pb_wo"): ("modelopt", "fp8_block", ("*q_proj", "*k_proj", "*v_proj")),
}
#: The engines' names in inspect's loader list (it appends the version it read them for).
INSPECT_NAMES = {"vllm": "vLLM", "transformers": "transformers"}


def _rows() -> list[Any]:
    params = []
    for engine in ("vllm", "transformers"):
        for row in get_engine(engine).table:
            if row.target != "hf_checkpoint":
                continue
            gpu = row.verdict is Verdict.RUNS and "cpu" not in row.devices
            # a row limited to some model types: a checkpoint of the first (inspect reads
            # config.json's model_type)
            family = row.model_types[0] if row.model_types else "llama"
            ident = f"{engine}-{family}-{row.layout}-{row.scheme}-{row.verdict.value}"
            params.append(
                pytest.param(engine, row, family, id=ident + ("-gpu-source" if gpu else ""))
            )
    return params


@functools.cache
def _checkpoint(root: Path, layout: str | None, scheme: str | None, family: str) -> Path:
    fmt, recipe, exclude = WRITERS[(layout, scheme)]
    model = build_model(family, seed=0)
    if recipe is not None:
        model = quantize(model, recipe, exclude=list(exclude) or None)
    options = {"format": fmt} if fmt else {}
    out: Path = exportlm.export_model(
        "hf_checkpoint", model, root / f"{family}-{fmt}-{recipe}", **options
    )
    return out


def _named(names: list[str], engine: str) -> bool:
    return any(n.split(" ")[0] == INSPECT_NAMES[engine] for n in names)


@pytest.mark.parametrize(("engine", "row", "family"), _rows())
def test_inspect_agrees_with_each_engine_table_row(
    engine: str, row: Support, family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.getbasetemp() / "engine-rows"
    root.mkdir(exist_ok=True)
    path = _checkpoint(root, row.layout, row.scheme, family)
    kind = artifact_kind(path)
    assert (kind.layout, kind.scheme) == (row.layout, row.scheme)  # the writer's layout
    assert kind.model_type == family
    if row.verdict is Verdict.MISREADS:
        assert kind.dtype in row.dtypes  # the row holds for this checkpoint's dtype
    report = inspect_checkpoint(path)
    loaders = [dict(f.details) for f in report.findings if f.rule == "quant-method-loaders"]
    known = loaders[0]["known"] if loaders else []
    refusing = [
        str(f.details["engine"]) for f in report.findings if f.rule == "engine-refuses-scheme"
    ]
    if row.verdict in (Verdict.REFUSED, Verdict.MISREADS):
        assert not _named(known, engine), (row.evidence, known)
        if row.verdict is Verdict.REFUSED:
            assert _named(refusing, engine), (row.evidence, refusing)
        return
    assert not _named(refusing, engine), (row.evidence, refusing)
    if row.layout is not None:
        assert _named(known, engine), (row.evidence, known)
