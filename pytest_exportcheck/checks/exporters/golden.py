"""Golden checks (scope ``"exporter"``): what an exporter writes for fixed quantized toy models.

Two checks, two kinds of comparison:

- ``golden_checkpoint`` compares *exactly*. Each :data:`GOLDEN_CASES` entry is a
  toy model quantized with :func:`exportlm.quant.synthetic_calibration`: every
  quantizer statistic comes from numpy's PCG64 stream, never from a forward
  pass, so every byte an exporter writes is a pure function of fixed inputs and
  is the same on every CPU, thread count and device. A golden per case and
  exporter, ``checkpoint/<case>/<exporter>.json``, records the tensors the
  exporter wrote (name, dtype, shape, sha256, values of scales, a summary of
  large tensors), the tied groups of the model, and the quantization configs
  written beside them (``hf_quant_config.json`` and ``config.json``'s
  ``quantization_config`` from the real ``hf_checkpoint`` writer for Hugging
  Face models, the driver's summary for the others; the producer version is
  masked).
- ``golden_calibration`` compares *within a tolerance*. The same cases are
  quantized with real max calibration (a forward pass on deterministic ids),
  and the activation scales the exporter wrote (``input_scale``, ``k_scale``,
  ``v_scale``, ``pre_quant_scale``) are compared with
  ``calibration/<exporter>.json`` within :data:`CALIBRATION_RTOL` /
  :data:`CALIBRATION_ATOL`. A forward pass's last bit depends on the machine's
  kernels, so no hash of these values is ever compared.

See :mod:`pytest_exportcheck.goldens` for the missing / update / mismatch outcomes.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exportlm.quant import PORTABLE_MARGIN, awq_margin
from pytest_exportcheck.checks._api import CheckResult, ExporterCase, check
from pytest_exportcheck.checks._common import (
    CheckAbort,
    aborts_to_result,
    error_text,
    golden_result,
)
from pytest_exportcheck.checks._registries import Registries
from pytest_exportcheck.checks._survey import (
    Calibration,
    QuantizedModel,
    RecipeKey,
    exporter_entry,
    recipe_label,
    survey_of,
)
from pytest_exportcheck.checks.exporters.values import (
    conformance_golden,
    no_golden_case,
    written_by,
    written_ties,
)
from pytest_exportcheck.goldens import GoldenStore, tensor_values, tensors_digest

__all__ = [
    "CALIBRATED_LEAVES",
    "CALIBRATION_ATOL",
    "CALIBRATION_RTOL",
    "GOLDEN_CASES",
    "GoldenCase",
    "golden_calibration",
    "golden_case",
    "golden_checkpoint",
]

#: ``golden_calibration`` tolerance: ``|obtained - golden| <= atol + rtol * |golden|``.
#: Calibrated scales are maxima of activations from a float32 forward pass; across
#: CPU kernel sets, thread counts and CUDA (TF32 off) they were measured to move by
#: a few float32 ULPs (relative 1e-7 to 1e-6); 1e-4 leaves two orders of margin
#: while a real calibration change (another input, another layer order) moves
#: them by percents.
CALIBRATION_RTOL = 1e-4
CALIBRATION_ATOL = 1e-12
#: Tensor-name leaves whose values come from calibration (a forward pass).
CALIBRATED_LEAVES = ("input_scale", "k_scale", "v_scale", "pre_quant_scale")
_MASKED = "<masked>"


@dataclass(frozen=True)
class GoldenCase:
    """One golden: a toy model family, a recipe and a checkpoint format.

    ``recipe`` is a recipe string or a mixed-precision mapping as sorted
    ``(pattern, recipe)`` pairs.
    """

    id: str
    model: str
    recipe: RecipeKey
    format: str = "modelopt"

    @property
    def recipe_text(self) -> str:
        """The recipe as written in the golden."""
        return recipe_label(self.recipe)


#: The golden cases, each a golden per exporter that writes something in it.
GOLDEN_CASES: tuple[GoldenCase, ...] = (
    GoldenCase("tied_decoder", "decoder_tied", "fp8"),
    GoldenCase("tied_llama", "llama_tied", "fp8"),
    GoldenCase("untied_decoder", "decoder", "fp8"),
    GoldenCase("untied_llama", "llama", "fp8"),
    GoldenCase("fp8_fused_experts", "mixtral", "fp8"),
    GoldenCase("fp8_bmm_experts", "gpt_oss", "fp8"),
    GoldenCase("fp8_iterable_experts", "iterable_moe", "fp8"),
    GoldenCase("fp8_dbrx_experts", "dbrx", "fp8"),
    GoldenCase("fp8_kv_cache", "llama", "fp8+fp8_kv"),
    GoldenCase("nvfp4", "llama", "nvfp4"),
    GoldenCase("int4_awq", "llama", "int4_awq"),
    GoldenCase("int8_wo", "llama", "int8_wo"),
    GoldenCase("int8_sq", "llama", "int8_sq"),
    GoldenCase(
        "mixed_precision",
        "llama",
        (("*", "fp8"), ("*.mlp.*", "nvfp4"), ("*embed_tokens", "int8_wo")),
    ),
    GoldenCase("compressed_tensors", "llama", "fp8", "compressed-tensors"),
    GoldenCase("w8a8", "llama", "w8a8", "compressed-tensors"),
    GoldenCase("w4a8_awq", "llama", "w4a8_awq"),
)


def golden_case(case_id: str) -> GoldenCase:
    """The :class:`GoldenCase` with id ``case_id``."""
    for case in GOLDEN_CASES:
        if case.id == case_id:
            return case
    known = ", ".join(c.id for c in GOLDEN_CASES)
    raise KeyError(f"unknown golden case {case_id!r}; known: {known}")


# ----------------------------------------------------------------------------- helpers


def _store(case: ExporterCase) -> GoldenStore | None:
    return case.goldens if isinstance(case.goldens, GoldenStore) else None


def _owner(case: ExporterCase) -> str | None:
    """The distribution that provides the case's exporter (``exportlm`` for built-ins)."""
    try:
        entry = case.services.registries.module_exporters.entry(case.name)
    except Exception:
        return None
    if entry.builtin:
        return "exportlm"
    return entry.distribution.split(" ")[0] if entry.distribution else None


def _quantized(case: ExporterCase, golden: GoldenCase, calibration: Calibration) -> QuantizedModel:
    """The surveyed golden case, quantized and exported on ``device``; a failed check when
    it cannot be quantized or exported."""
    survey = survey_of(
        (golden.model,),
        case.seed,
        (golden.recipe,),
        calibration=calibration,
        format="compressed-tensors" if golden.format == "compressed-tensors" else "modelopt",
        device=case.device,
        services=case.services,
    )
    if survey.skipped:
        reason = next(iter(survey.skipped.values()))
        raise CheckAbort(CheckResult.failed(f"golden case {golden.id}: {reason}"))
    q = survey.quantized[0]
    if q.error:
        raise CheckAbort(
            CheckResult.failed(f"golden case {golden.id}: {q.error}", exception=q.exception)
        )
    return q


def _mask_producer(config: Any) -> Any:
    """``config`` with every ``producer.version`` replaced: goldens outlive releases."""
    if isinstance(config, Mapping):
        return {
            k: {**v, "version": _MASKED}
            if k == "producer" and isinstance(v, Mapping)
            else _mask_producer(v)
            for k, v in config.items()
        }
    if isinstance(config, list):
        return [_mask_producer(v) for v in config]
    return config


def _written_configs(case: ExporterCase, q: QuantizedModel, golden: GoldenCase) -> dict[str, Any]:
    """The configs the ``hf_checkpoint`` writer puts beside the tensors (HF models only):
    one checkpoint write per quantized model (the key holds it) and ``case.services``."""
    return case.services.memo(
        ("golden configs", q.model, golden.format),
        lambda: _write_configs(case.services.registries, q, golden, case.workdir),
    )


def _write_configs(
    registries: Registries, q: QuantizedModel, golden: GoldenCase, workdir: Path
) -> dict[str, Any]:
    info = registries.target_info("hf_checkpoint")
    if info.accepts is not None and info.accepts(q.model):
        return {}  # not a Hugging Face model: the driver's summary is the config
    workdir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"golden-{golden.id}-", dir=workdir))
    out = registries.export("hf_checkpoint", q.model, scratch / "checkpoint", format=golden.format)
    configs: dict[str, Any] = {}
    hf_quant = out / "hf_quant_config.json"
    if hf_quant.exists():
        configs["hf_quant_config.json"] = _mask_producer(json.loads(hf_quant.read_text()))
    config = json.loads((out / "config.json").read_text())
    if "quantization_config" in config:
        configs["config.json:quantization_config"] = _mask_producer(config["quantization_config"])
    return configs


def _checkpoint_data(
    case: ExporterCase, q: QuantizedModel, golden: GoldenCase, names: list[str]
) -> dict[str, Any]:
    exporter, seed = case.name, case.seed
    configs = _written_configs(case, q, golden)
    data: dict[str, Any] = {
        "case": golden.id,
        "model": golden.model,
        "recipe": golden.recipe_text,
        "format": golden.format,
        "seed": seed,
        "calibration": f"synthetic_calibration(seed={seed})",
        "exporter": exporter,
        "tensors": tensors_digest({n: q.tensors[n] for n in names}),
        "configs": configs,
    }
    if not configs and q.summary is not None:  # no checkpoint writer for this model
        from exportlm.export.hf_checkpoint.configs import CheckpointQuantization

        # the section the checkpoint writer's one builder makes, under the exported names
        data["quantization"] = CheckpointQuantization.of(q.summary).hf_quant_config()
    ties = written_ties(q)
    if ties:
        data["ties"] = dict(sorted(ties.items()))
    return data


def _combine(results: Iterable[tuple[str, CheckResult]], what: str) -> CheckResult:
    results = list(results)
    failed = [(k, r) for k, r in results if r.status == "fail"]
    goldens = [g for _, r in results for g in r.details.get("goldens", [])]
    if failed:
        text = "\n".join(f"[{k}] {r.message}" for k, r in failed)
        return CheckResult.failed(
            f"{len(failed)} of {len(results)} {what} golden(s) differ:\n{text}", goldens=goldens
        )
    notes = "; ".join(f"{k}: {r.message}" for k, r in results)
    return CheckResult.passed(f"{len(results)} {what} golden(s): {notes}", goldens=goldens)


# ----------------------------------------------------------------------------- checks


@check("golden_checkpoint")
@aborts_to_result
def golden_checkpoint(case: ExporterCase) -> CheckResult:
    """What the exporter writes for every golden case equals its golden, byte for byte.

    Exact comparison (``atol = rtol = 0``, sha256 of the bytes): the cases are
    quantized with ``synthetic_calibration``, so the exporter's inputs are the
    same bits on every machine and device, and so must its outputs be. Golden
    ``checkpoint/<case>/<exporter>.json`` per case of :data:`GOLDEN_CASES` in
    which the exporter writes something: its tensors (values of scales, a
    summary of large tensors, shown in a mismatch but not compared), the tied
    groups and the quantization configs written beside them. The exporter's
    ``conformance_model(seed)``, when it has one, is one more case,
    ``checkpoint/conformance/<exporter>.json`` (with the driver's quantization
    summary as its config). Fails (``value_coverage``) when the exporter writes
    nothing in any case, claims no toy-model module and has no conformance model;
    skips when it claims toy-model modules only, or without a golden store.
    """
    exporter_entry(case)
    store = _store(case)
    if store is None:
        return CheckResult.skipped("no golden store in the case (the plugin passes one)")
    results: list[tuple[str, CheckResult]] = []
    claims = 0  # modules of the golden cases' toy models the exporter claims
    for golden in GOLDEN_CASES:
        q = _quantized(case, golden, "synthetic")
        claims += sum(1 for c in q.claims if c.exporter == case.name)
        names = written_by(q, case.name)
        if not names:
            continue
        try:
            data = _checkpoint_data(case, q, golden, names)
        except Exception as err:
            return CheckResult.failed(f"golden case {golden.id}: {error_text(err)}", exception=err)
        outcome = store.check(f"checkpoint/{golden.id}/{case.name}", data, owner=_owner(case))
        result = golden_result(outcome)
        results.append((golden.id, result))
    own = conformance_golden(case, store, owner=_owner(case))
    if own is not None:
        results.append(("conformance", own))
    if not results:
        return no_golden_case(case, [g.id for g in GOLDEN_CASES], claims)
    return _combine(results, "checkpoint")


def _calibrated(q: QuantizedModel, names: list[str]) -> dict[str, list[Any]]:
    leaf = re.compile(r"(^|\.)(" + "|".join(CALIBRATED_LEAVES) + r")$")
    return {n: tensor_values(q.tensors[n]) for n in sorted(names) if leaf.search(n)}


@check("golden_calibration")
@aborts_to_result
def golden_calibration(case: ExporterCase) -> CheckResult:
    """The activation scales the exporter writes after real calibration match the golden's
    within ``rtol=1e-4, atol=1e-12`` (``|obtained - golden| <= atol + rtol * |golden|``).

    The golden cases are quantized with max calibration on deterministic ids
    (a forward pass), so the scales differ in the last bits between machines:
    they are compared within that tolerance, never by hash. Golden
    ``calibration/<exporter>.json``: per case, ``input_scale``, ``k_scale``,
    ``v_scale`` and ``pre_quant_scale`` values. Skips when the exporter writes no
    such scale in any case. An update refuses a case whose AWQ scales were decided
    within float noise (:func:`exportlm.quant.awq_margin` at most
    :data:`exportlm.quant.PORTABLE_MARGIN`): its golden would not hold elsewhere.
    """
    exporter_entry(case)
    store = _store(case)
    if store is None:
        return CheckResult.skipped("no golden store in the case (the plugin passes one)")
    cases: dict[str, Any] = {}
    for golden in GOLDEN_CASES:
        q = _quantized(case, golden, "data")
        margin = awq_margin(q.model)
        if store.update and margin <= PORTABLE_MARGIN:
            return CheckResult.failed(
                f"golden case {golden.id} is not portable: an AWQ scale was chosen by a "
                f"relative margin of {margin:.3g} <= {PORTABLE_MARGIN:g} (float noise), so "
                "another machine may choose another; change the case's seed or calibration "
                "data, not the golden (see exportlm.quant.awq_margin)"
            )
        values = _calibrated(q, written_by(q, case.name))
        if values:
            cases[golden.id] = {
                "model": golden.model,
                "recipe": golden.recipe_text,
                "approx": values,
            }
    if not cases:
        return CheckResult.skipped(
            f"module exporter {case.name!r} writes no calibrated scale in the golden cases "
            "(the scales of its conformance_model(), calibrated by its author, are compared "
            "exactly by golden_checkpoint)"
        )
    data = {
        "exporter": case.name,
        "seed": case.seed,
        "calibration": "max calibration, one forward on make_input_ids(vocab_size) (PCG64 ids)",
        "tolerance": {"rtol": CALIBRATION_RTOL, "atol": CALIBRATION_ATOL},
        "cases": cases,
    }
    return golden_result(store.check(f"calibration/{case.name}", data, owner=_owner(case)))
