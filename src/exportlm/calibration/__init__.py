"""Calibration data for :func:`exportlm.quant.quantize`: texts -> token batches -> ``calibrate``.

Max calibration sets every activation scale from the largest value seen while
the model runs on calibration data, so the data should look like what the
model will serve. Three steps, each usable alone::

    texts = load_calibration_texts("calib.txt", samples=128)
    tokenizer = load_local_tokenizer("path/to/model")  # None when the directory has none
    batches = calibration_batches(texts, tokenizer, vocab_size=32000, seq_len=512, batch_size=8)
    quantize(model, "fp8", calibrate=calibrate_with(batches))

Sources (:func:`load_calibration_texts`):

* a text file: one sample per line, blank lines skipped;
* a ``.json`` file holding a list of strings;
* a directory written by ``datasets.Dataset.save_to_disk`` (needs the
  ``datasets`` package): the ``text`` column, or the only string column; of a
  ``DatasetDict``, the ``train`` split or the only split.

Batching (:func:`calibration_batches`) packs the samples: the token ids of all
texts are joined (separated by the tokenizer's EOS token when it has one) and
cut into rows of ``seq_len`` tokens, ``batch_size`` rows per batch; a final
partial row is a batch of its own, so every token is seen exactly once and no
padding or attention mask is needed. Without a tokenizer (the toy families),
each text becomes its UTF-8 bytes, each byte modulo the vocabulary size, texts
separated by a newline byte: deterministic, but not language the model knows.

Nothing here downloads anything, blocks or runs a model directory's code:
tokenizers load from local files only with ``trust_remote_code=False``, a
directory that would run its own code is refused
(:class:`~exportlm.errors.CustomCodeRefusedError`), and a FIFO, device or socket
given as (or inside) the data is refused before it is opened.

Nothing here reads without bound: a text file is read in chunks, only as far as
the samples asked for, and a line longer than :data:`MAX_SAMPLE_BYTES` (1 MiB)
is refused with its size; a ``.json`` file is read only up to
:data:`MAX_JSON_BYTES`; a dataset directory's files must lie inside it
(``exportlm/calibration/_dataset.py``); a tokenizer that fails in any way (a Rust
panic included) raises :class:`CalibrationDataError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exportlm._progress import progress
from exportlm.calibration._common import (
    MAX_JSON_BYTES,
    MAX_SAMPLE_BYTES,
    SOURCES,
    CalibrationDataError,
)
from exportlm.calibration._dataset import dataset_texts
from exportlm.calibration._text import json_texts, text_lines
from exportlm.calibration._tokenizer import TOKENIZER_FILES, encode, load_local_tokenizer
from exportlm.errors import NotRegularFileError
from exportlm.safeio import ensure_no_special_files, ensure_regular_file

if TYPE_CHECKING:  # torch is imported where it is used, so the defaults import cheaply
    import torch
    from torch import nn

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_SAMPLES",
    "DEFAULT_SEQ_LEN",
    "MAX_JSON_BYTES",
    "MAX_SAMPLE_BYTES",
    "TOKENIZER_FILES",
    "CalibrationDataError",
    "calibrate_with",
    "calibration_batches",
    "load_calibration_texts",
    "load_local_tokenizer",
    "utf8_byte_ids",
]

#: Samples read by default (all of them when the source holds fewer).
DEFAULT_SAMPLES = 128
#: Tokens per calibration row by default (capped by the model's positions).
DEFAULT_SEQ_LEN = 512
#: Rows per forward pass by default.
DEFAULT_BATCH_SIZE = 8


def load_calibration_texts(path: str | Path, samples: int | None = DEFAULT_SAMPLES) -> list[str]:
    """The first ``samples`` non-blank texts of ``path`` (all of them for ``None``).

    Raises:
        CalibrationDataError: a missing path, an unreadable or malformed file, a
            line longer than :data:`MAX_SAMPLE_BYTES`, a ``.json`` file over
            :data:`MAX_JSON_BYTES`, a dataset directory naming a file outside it or
            that ``datasets`` cannot read, a dataset without one clear text column, ``datasets`` not installed for
            a dataset directory, or no sample at all.
    """
    if samples is not None and samples < 1:
        raise CalibrationDataError(f"samples must be at least 1, got {samples}")
    source = Path(path)
    if not source.exists():
        raise CalibrationDataError(f"calibration data {source}: no such file or directory")
    _refuse_special(source)
    if source.is_dir():
        texts = dataset_texts(source, samples)
    elif source.suffix.lower() == ".json":
        texts = json_texts(source)
    else:
        texts = text_lines(source, samples)
    texts = [t for t in texts if t.strip()][:samples]
    if not texts:
        raise CalibrationDataError(
            f"calibration data {source} holds no non-blank sample; {SOURCES}"
        )
    return texts


def _refuse_special(source: Path) -> None:
    """A FIFO, device or socket as the data (or in a dataset directory) would block the read."""
    try:
        if source.is_dir():
            ensure_no_special_files(source, what="calibration dataset", max_depth=3)
        else:
            ensure_regular_file(source, what="calibration data")
    except NotRegularFileError as err:
        raise CalibrationDataError(f"{err} ({SOURCES})") from err


def utf8_byte_ids(text: str, vocab_size: int) -> list[int]:
    """The fallback tokenization: each UTF-8 byte of ``text`` modulo ``vocab_size``."""
    return [byte % vocab_size for byte in text.encode("utf-8")]


def calibration_batches(
    texts: Sequence[str],
    tokenizer: Any | None,
    vocab_size: int,
    seq_len: int = DEFAULT_SEQ_LEN,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> list[torch.Tensor]:
    """Pack ``texts`` into ``input_ids`` batches (int64 ``[rows, seq_len]``; see the module docstring).

    ``tokenizer`` is a transformers tokenizer (called on each text, special
    tokens included) or ``None`` for :func:`utf8_byte_ids`.

    Raises:
        CalibrationDataError: no texts, a size below 1, or a token id the
            model's vocabulary of ``vocab_size`` does not have (a tokenizer that
            does not belong to the model).
    """
    for name, value in (
        ("vocab_size", vocab_size),
        ("seq_len", seq_len),
        ("batch_size", batch_size),
    ):
        if value < 1:
            raise CalibrationDataError(f"{name} must be at least 1, got {value}")
    if not texts:
        raise CalibrationDataError("no calibration texts to tokenize")
    stream = _token_stream(texts, tokenizer, vocab_size)
    whole = len(stream) // seq_len * seq_len
    # Views of the one stream tensor: 8 bytes a token, no per-token Python objects.
    batches = list(stream[:whole].view(-1, seq_len).split(batch_size)) if whole else []
    if whole < len(stream):
        batches.append(stream[whole:].unsqueeze(0))
    return batches


def _token_stream(texts: Sequence[str], tokenizer: Any | None, vocab_size: int) -> torch.Tensor:
    """The token ids of all ``texts``, separated, as one int64 tensor (see the module docstring)."""
    import torch

    if tokenizer is None:
        data = bytearray(b"\n".join(text.encode("utf-8") for text in texts))
        if not data:
            return torch.zeros(0, dtype=torch.long)
        return torch.frombuffer(data, dtype=torch.uint8).long().remainder_(vocab_size)
    eos = getattr(tokenizer, "eos_token_id", None)
    separator = [eos] if isinstance(eos, int) else []
    parts = [
        torch.tensor((separator if index else []) + encode(tokenizer, text, index))
        for index, text in enumerate(texts)
    ]
    stream = torch.cat(parts).long() if parts else torch.zeros(0, dtype=torch.long)
    too_large = int(stream.max()) if len(stream) else 0
    if too_large >= vocab_size:
        raise CalibrationDataError(
            f"the tokenizer produced token id {too_large}, outside the model's vocabulary of "
            f"{vocab_size}; the tokenizer does not belong to this model"
        )
    return stream


def calibrate_with(
    batches: Sequence[torch.Tensor], *, desc: str = "calibrating"
) -> Callable[[nn.Module], None]:
    """A ``calibrate(model)`` for :func:`exportlm.quant.quantize` that runs ``model`` on ``batches``.

    Each batch is moved to the model's device and run without gradients and without a
    KV cache; progress is reported per batch as ``desc`` (a bar on a terminal). The
    output head computes the last position only (``logits_to_keep=1``) when the model
    takes that argument and its head is not quantized: no calibration statistic reads
    the logits, and a full ``[rows, seq, vocabulary]`` float32 tensor is 100 MB per
    512-token row at a 49k vocabulary.

    Under an initialised ``torch.distributed`` process group of ``N`` ranks, rank ``r``
    runs batches ``r, r + N, r + 2N, ...`` only; ``quantize`` then takes the maximum of
    every activation amax over the ranks (data-parallel calibration, ``docs/streaming.md``).
    """
    if not batches:
        raise CalibrationDataError("calibrate_with needs at least one batch")

    def calibrate(model: nn.Module) -> None:
        import torch

        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        lean = _lean_forward_kwargs(model)
        share = _rank_share(batches)
        with torch.no_grad():
            for batch in progress(share, desc, total=len(share), unit="batch"):
                model(batch.to(device), **lean)

    return calibrate


def _rank_share(batches: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """This rank's batches under a multi-process group (every ``N``-th from its rank), else all."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return batches
    return batches[dist.get_rank() :: dist.get_world_size()]


def _lean_forward_kwargs(model: nn.Module) -> dict[str, Any]:
    """The forward arguments that skip work calibration never reads (a cache, full logits)."""
    import inspect

    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # no signature to read: call it plainly
        return {}
    kwargs: dict[str, Any] = {}
    if "use_cache" in parameters:
        kwargs["use_cache"] = False
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    quantized_head = head is None or any(n.endswith("_quantizer") for n, _ in head.named_modules())
    if "logits_to_keep" in parameters and not quantized_head:
        kwargs["logits_to_keep"] = 1
    return kwargs
