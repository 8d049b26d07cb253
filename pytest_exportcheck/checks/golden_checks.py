"""Golden checks (scope ``"exporter"``): what an exporter writes for fixed toy models, hashed.

Each golden is per exporter, ``goldens/<check>/<exporter>.json``, and holds the
tensors that exporter wrote (name -> dtype, shape, sha256 of the bytes) for a
seeded toy model, so a change in names, layout, dtype or a single bit of an
FP8 weight or scale shows up as a readable diff. An exporter that writes
nothing for the golden's model skips. See :mod:`pytest_exportcheck.goldens` for
the missing / update / mismatch outcomes.
"""

from __future__ import annotations

from typing import Any

from pytest_exportcheck.checks._api import CheckResult, ExporterCase, check
from pytest_exportcheck.checks._support import aborts_to_result
from pytest_exportcheck.checks._survey import QuantizedModel, exporter_entry, survey_of
from pytest_exportcheck.goldens import GoldenStore, tensors_digest

__all__ = ["FP8_GOLDEN_MODEL", "TIED_GOLDEN_MODELS", "golden_fp8_buffers", "golden_tied_weights"]

#: ``(model, recipe)`` of ``golden_fp8_buffers``.
FP8_GOLDEN_MODEL = ("decoder", "fp8")
#: Tied toy models of ``golden_tied_weights`` (quantized with FP8).
TIED_GOLDEN_MODELS = ("decoder_tied", "llama_tied")


def _store(case: ExporterCase) -> GoldenStore | None:
    return case.goldens if isinstance(case.goldens, GoldenStore) else None


def _written_by(q: QuantizedModel, exporter: str) -> list[str]:
    return [n for c in q.calls if c.exporter == exporter for n in c.names]


def _find(models: tuple[str, ...], recipe: str, seed: int) -> list[QuantizedModel]:
    survey = survey_of(models, seed, recipes=(recipe,))
    return [q for q in survey.quantized if q.recipe == recipe]


@check("golden_fp8_buffers", scope="exporter")
@aborts_to_result
def golden_fp8_buffers(case: ExporterCase) -> CheckResult:
    """The FP8 tensors the exporter writes for the FP8 ``decoder`` (seed 0) match their golden.

    Golden ``fp8_buffers/<exporter>.json``: every ``weight`` (float8_e4m3fn),
    ``weight_scale`` and ``input_scale`` (float32, 0-d) the exporter wrote, by
    name, with dtype, shape and the sha256 of the bytes. Skips when the exporter
    writes nothing for that model or no golden store is configured.
    """
    exporter_entry(case)
    store = _store(case)
    if store is None:
        return CheckResult.skipped("no golden store in the case (the plugin passes one)")
    model, recipe = FP8_GOLDEN_MODEL
    quantized = _find((model,), recipe, case.seed)
    if not quantized or quantized[0].error:
        error = quantized[0].error if quantized else f"{recipe} does not apply to {model}"
        return CheckResult.failed(f"exporting the {recipe} {model!r} failed: {error}")
    q = quantized[0]
    names = _written_by(q, case.name)
    if not names:
        return CheckResult.skipped(
            f"module exporter {case.name!r} writes nothing for the {recipe} {model!r}"
        )
    data: dict[str, Any] = {
        "model": model,
        "recipe": recipe,
        "seed": case.seed,
        "exporter": case.name,
        "tensors": tensors_digest({n: q.tensors[n] for n in names}),
    }
    return store.check(f"fp8_buffers/{case.name}", data)


@check("golden_tied_weights", scope="exporter")
@aborts_to_result
def golden_tied_weights(case: ExporterCase) -> CheckResult:
    """Which names the tied toy models export as, and which copy of each tie is kept, match the golden.

    Golden ``tied_weights/<exporter>.json``: for ``decoder_tied`` and
    ``llama_tied`` quantized with FP8, the tensors the exporter wrote (digests)
    and, per tied group, the names written (exactly one, the tie's source name).
    Skips when the exporter writes nothing in those models.
    """
    exporter_entry(case)
    store = _store(case)
    if store is None:
        return CheckResult.skipped("no golden store in the case (the plugin passes one)")
    data: dict[str, Any] = {"seed": case.seed, "exporter": case.name, "models": {}}
    for q in _find(TIED_GOLDEN_MODELS, "fp8", case.seed):
        if q.error:
            return CheckResult.failed(f"exporting the fp8 {q.model_name!r} failed: {q.error}")
        names = _written_by(q, case.name)
        if not names:
            continue
        groups: dict[str, list[str]] = {}
        for name, param in q.model.named_parameters(remove_duplicate=False):
            groups.setdefault(str(id(param)), []).append(name)
        ties = {
            "=".join(group): sorted(n for n in group if n in q.tensors)
            for group in groups.values()
            if len(group) > 1
        }
        data["models"][q.model_name] = {
            "tensors": tensors_digest({n: q.tensors[n] for n in names}),
            "ties": dict(sorted(ties.items())),
        }
    if not data["models"]:
        return CheckResult.skipped(
            f"module exporter {case.name!r} writes nothing in {', '.join(TIED_GOLDEN_MODELS)}"
        )
    return store.check(f"tied_weights/{case.name}", data)
