"""``export --quantize``: check the calibration flags, calibrate and quantize, narrate it."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exportlm.calibration import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_SAMPLES,
    DEFAULT_SEQ_LEN,
    calibrate_with,
    calibration_batches,
    load_calibration_texts,
    load_local_tokenizer,
)
from exportlm.cli._errors import UsageError
from exportlm.cli._model import ModelSource

__all__ = ["CalibrationRequest", "calibration_request", "quantize_model"]

logger = logging.getLogger("exportlm.cli")

_CALIB_FLAGS = ("calib_samples", "calib_seq_len", "calib_batch_size")
_HOW_TO_PASS = (
    "pass --calib-data PATH (a text file with one sample per line, a .json list of "
    "strings, or a datasets save_to_disk directory)"
)


@dataclass(frozen=True)
class CalibrationRequest:
    """What ``--calib-*`` asked for; ``texts`` is ``None`` for the synthetic default.

    ``seq_len`` is ``None`` when not given: :data:`~exportlm.calibration.DEFAULT_SEQ_LEN`,
    capped by the model's positions without a word.
    """

    data: Path | None
    texts: list[str] | None
    seq_len: int | None
    batch_size: int


def calibration_request(args: argparse.Namespace, recipe: Any = None) -> CalibrationRequest | None:
    """The checked calibration flags, texts already read; ``None`` without ``--quantize``.

    ``recipe`` (a :class:`~exportlm.quant.QuantRecipe`) that runs no calibration forward
    (weight-only, ``int8_wo``): ``--calib-data`` is not read, and a warning says so.

    Raises:
        UsageError: a ``--calib-*`` flag without ``--quantize`` or ``--calib-data``.
        CalibrationDataError: the data cannot be read (see
            :func:`exportlm.calibration.load_calibration_texts`).
    """
    given = [f"--{f.replace('_', '-')}" for f in _CALIB_FLAGS if getattr(args, f) is not None]
    if args.quantize is None:
        if args.calib_data is not None or given:
            flags = ", ".join(["--calib-data"] * (args.calib_data is not None) + given)
            raise UsageError(f"{flags}: only used with --quantize RECIPE")
        return None
    if args.calib_data is None:
        if given:
            raise UsageError(f"{', '.join(given)}: only used with --calib-data PATH")
        return CalibrationRequest(None, None, None, DEFAULT_BATCH_SIZE)
    if recipe is not None and not _recipe_calibrates(recipe):
        logger.warning(
            "--calib-data %s is not read: recipe %s is weight-only (every scale comes from "
            "the weights), so it runs no calibration",
            args.calib_data,
            args.quantize,
        )
        return CalibrationRequest(None, None, None, DEFAULT_BATCH_SIZE)
    samples = args.calib_samples or DEFAULT_SAMPLES
    return CalibrationRequest(
        data=args.calib_data,
        texts=load_calibration_texts(args.calib_data, samples),
        seq_len=args.calib_seq_len,
        batch_size=args.calib_batch_size or DEFAULT_BATCH_SIZE,
    )


def _recipe_calibrates(recipe: Any) -> bool:
    """Some weight recipe of ``recipe`` (a ``QuantRecipe``) or its KV cache needs forwards."""
    return recipe.kv_cache is not None or any(a.calibrates for a in recipe.algorithms())


def quantize_model(
    model: Any, recipe: Any, request: CalibrationRequest, source: ModelSource
) -> tuple[Any, dict[str, Any]]:
    """Quantize ``model`` with ``recipe`` on the requested calibration data.

    The recipe is checked against the model first (:func:`exportlm.quant.check_recipe`; exit 2),
    so a shape it cannot take is refused before the data is tokenized or a forward runs;
    a weight-only recipe runs no calibration at all. Returns the quantized model and a
    JSON description of the calibration (``export --json`` prints it).
    """
    from exportlm.cli._recipe import check_recipe_on, warn_unmatched_excludes
    from exportlm.quant import is_quantized_module, quantize

    if source.kind != "directory":  # a directory's meta model was asked already
        warn_unmatched_excludes(model, recipe)
    if check_recipe_on(model, recipe):
        calibrate, report = _calibration(model, request, source)
    else:
        calibrate, report = None, {"source": "none: weight-only, every scale from the weights"}
    label = _label(recipe)
    logger.info("quantizing with %s...", label)
    start = time.perf_counter()
    model = quantize(model, recipe, calibrate=calibrate)
    count = sum(1 for module in model.modules() if is_quantized_module(module))
    logger.info("quantized %d modules (%s) in %.1f s", count, label, time.perf_counter() - start)
    return model, {**report, "quantized_modules": count}


def _label(recipe: Any) -> str:
    """A recipe as spelled: the string itself, or a ``QuantRecipe``'s default and KV parts."""
    if isinstance(recipe, str):
        return recipe
    return "+".join(p for p in (recipe.algo, recipe.kv_cache) if p) or "the recipe"


def _calibration(
    model: Any, request: CalibrationRequest, source: ModelSource
) -> tuple[Callable[[Any], None] | None, dict[str, Any]]:
    """The ``calibrate`` callable for ``quantize`` (``None``: its synthetic default) and a report."""
    if request.texts is None:
        logger.warning(
            "calibrating on synthetic random input ids (one batch of 2 x 8 tokens): the "
            "activation scales do not reflect real data; %s",
            _HOW_TO_PASS,
        )
        return None, {"source": "synthetic"}
    from exportlm.inputs import infer_vocab_size

    vocab_size = infer_vocab_size(model)
    tokenizer = (
        load_local_tokenizer(source.path) if source.kind == "directory" and source.path else None
    )
    if tokenizer is None:
        logger.info(
            "%s has no tokenizer: calibration texts become UTF-8 byte ids modulo the "
            "vocabulary size (%d)",
            source.name,
            vocab_size,
        )
    seq_len = _capped_seq_len(model, request.seq_len)
    batches = calibration_batches(request.texts, tokenizer, vocab_size, seq_len, request.batch_size)
    tokens = sum(batch.numel() for batch in batches)
    logger.info(
        "calibration data: %d samples from %s, %d tokens in %d batch(es) of up to %d x %d",
        len(request.texts),
        request.data,
        tokens,
        len(batches),
        request.batch_size,
        seq_len,
    )
    report = {
        "source": str(request.data),
        "samples": len(request.texts),
        "tokens": tokens,
        "batches": len(batches),
        "seq_len": seq_len,
        "batch_size": request.batch_size,
        "tokenizer": "utf8-bytes" if tokenizer is None else str(source.path),
    }
    return calibrate_with(batches), report


def _capped_seq_len(model: Any, requested: int | None) -> int:
    """The requested (or default) row length, or the model's positions when that is smaller."""
    seq_len = requested or DEFAULT_SEQ_LEN
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and 0 < limit < seq_len:
        logger.log(
            logging.INFO if requested else logging.DEBUG,
            "calibration rows of %d tokens exceed the model's %d positions; using %d",
            seq_len,
            limit,
            limit,
        )
        return limit
    return seq_len
