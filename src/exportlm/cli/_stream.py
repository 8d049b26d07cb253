"""``export --stream`` / ``--max-memory``: when to export layer by layer, and doing it.

``exportlm export --target hf_checkpoint --model DIR`` streams by itself when the model
would not fit the memory it may use (:func:`exportlm.stream.should_stream`: the cgroup
limit, else the available memory, or the ``--max-memory`` budget); ``--stream`` forces it.
Only a local model directory and the ``hf_checkpoint`` target stream. The command decides
before it loads anything, by the rule ``export_model(..., stream="auto")`` applies, and
then calls ``export_model("hf_checkpoint", DIR, out, stream=True, ...)``
(:func:`source_options`), as a library user would.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from exportlm.cli._errors import UsageError

__all__ = ["STREAM_OPTIONS", "source_options", "stream_batches", "wants_streaming"]

logger = logging.getLogger("exportlm.cli")

#: ``-o`` options of ``hf_checkpoint`` that a streaming export takes too.
STREAM_OPTIONS = ("format", "max_shard_size", "dtype", "overwrite")


def wants_streaming(
    args: argparse.Namespace, target: str, source: Any, options: dict[str, Any]
) -> bool:
    """Whether this export streams; raises :class:`UsageError` for a combination that cannot.

    ``source`` is the :class:`~exportlm.cli._model.ModelSource` of ``--model``.
    """
    forced, budget = bool(getattr(args, "stream", False)), getattr(args, "max_memory", None)
    from exportlm.errors import InvalidInputError
    from exportlm.stream import model_bytes, parse_memory, should_stream

    if budget is not None:
        try:
            parse_memory(budget)
        except InvalidInputError as err:
            raise UsageError(f"--max-memory {budget}: {err}") from None
    streamable = target == "hf_checkpoint" and source.kind == "directory"
    if not streamable:
        # a budget nothing would follow is refused, as --stream is: a toy model, or another
        # target, is built and exported in memory whatever the budget says
        for flag, given in (("--stream", forced), ("--max-memory", budget is not None)):
            if given:
                raise UsageError(
                    f"{flag}: only --target hf_checkpoint with a local model directory "
                    "(--model DIR) streams layer by layer; any other export runs in memory, "
                    f"which {flag} cannot change"
                )
        return False
    stream = forced or should_stream(source.path, budget)
    if stream and not forced:
        logger.info(
            "%s (%.2f GB of weights) would not fit the memory budget in one piece: "
            "exporting layer by layer (see docs/streaming.md)",
            source.name,
            model_bytes(source.path) / 1e9,
        )
    unknown = sorted(set(options) - set(STREAM_OPTIONS))
    if stream and unknown:
        raise UsageError(
            f"-o {', '.join(unknown)}: not taken by a streaming export "
            f"(it takes {', '.join(STREAM_OPTIONS)})"
        )
    if stream and args.verify:
        raise UsageError(
            "--verify compares with the model in memory, which a streaming export never "
            "holds; verify the checkpoint with `exportlm verify` on a machine where it fits"
        )
    return stream


def source_options(plan: Any) -> dict[str, Any]:
    """``export_model``'s options for a streamed ``plan``: the source options (the model
    directory read with ``stream=True``, its recipe and calibration) and the ``-o`` ones."""
    return {
        "stream": True,
        "recipe": plan.quant_recipe,
        "calibration": stream_batches(plan.calibration, plan.source),
        "max_memory": plan.max_memory,
        "calibration_inputs": "float" if plan.stream_inputs == "float" else "quantized",
        **plan.options,
    }


def stream_batches(request: Any, source: Any) -> list[Any] | None:
    """The calibration ``input_ids`` batches of a ``--calib-*`` request; ``None``: the default."""
    if request is None or request.texts is None:
        return None
    from transformers import AutoConfig

    from exportlm.calibration import DEFAULT_SEQ_LEN, calibration_batches, load_local_tokenizer

    config = AutoConfig.from_pretrained(source.path, local_files_only=True, trust_remote_code=False)
    tokenizer = load_local_tokenizer(Path(source.path))
    vocab = int(config.vocab_size)
    seq_len = request.seq_len or DEFAULT_SEQ_LEN
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and 0 < limit < seq_len:
        seq_len = limit
    return list(calibration_batches(request.texts, tokenizer, vocab, seq_len, request.batch_size))
