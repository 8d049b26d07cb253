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
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exportlm._progress import progress
from exportlm.errors import ExportLMError, NotRegularFileError
from exportlm.hfdir import refuse_custom_code
from exportlm.safeio import ensure_no_special_files, ensure_regular_file, open_regular

if TYPE_CHECKING:  # torch is imported where it is used, so the defaults import cheaply
    import torch
    from torch import nn

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_SAMPLES",
    "DEFAULT_SEQ_LEN",
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
#: Files whose presence in a model directory means it ships a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

_DATASET_MARKERS = ("dataset_dict.json", "state.json")
_STRING_DTYPES = ("string", "large_string")
_SOURCES = (
    "expected a text file (one sample per line), a .json file holding a list of strings, "
    "or a directory written by datasets' save_to_disk"
)


class CalibrationDataError(ExportLMError, ValueError):
    """Calibration data cannot be read, holds no usable samples, or does not fit the model."""


def load_calibration_texts(path: str | Path, samples: int | None = DEFAULT_SAMPLES) -> list[str]:
    """The first ``samples`` non-blank texts of ``path`` (all of them for ``None``).

    Raises:
        CalibrationDataError: a missing path, an unreadable or malformed file, a
            dataset without one clear text column, ``datasets`` not installed for
            a dataset directory, or no sample at all.
    """
    if samples is not None and samples < 1:
        raise CalibrationDataError(f"samples must be at least 1, got {samples}")
    source = Path(path)
    if not source.exists():
        raise CalibrationDataError(f"calibration data {source}: no such file or directory")
    _refuse_special(source)
    if source.is_dir():
        texts = _dataset_texts(source, samples)
    elif source.suffix.lower() == ".json":
        texts = _json_texts(source)
    else:
        texts = _text_lines(source, samples)
    texts = [t for t in texts if t.strip()][:samples]
    if not texts:
        raise CalibrationDataError(
            f"calibration data {source} holds no non-blank sample; {_SOURCES}"
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
        raise CalibrationDataError(f"{err} ({_SOURCES})") from err


def _open_text(path: Path) -> io.TextIOWrapper:
    """``path`` opened for UTF-8 reading, a special file refused on the same descriptor."""
    try:
        return io.TextIOWrapper(open_regular(path, what="calibration data"), encoding="utf-8")
    except NotRegularFileError as err:
        raise CalibrationDataError(f"{err} ({_SOURCES})") from err


def _text_lines(path: Path, samples: int | None) -> list[str]:
    """The first ``samples`` non-blank lines, read lazily (a corpus file can be large)."""
    lines: list[str] = []
    try:
        with _open_text(path) as handle:
            for line in handle:
                text = line.rstrip("\n")
                if text.strip():
                    lines.append(text)
                    if samples is not None and len(lines) >= samples:
                        break
    except UnicodeDecodeError as err:
        raise CalibrationDataError(
            f"calibration data {path} is not UTF-8 text ({err.reason}); {_SOURCES}"
        ) from err
    except OSError as err:
        raise CalibrationDataError(f"calibration data {path}: cannot read it: {err}") from err
    return lines


def _read(path: Path) -> str:
    try:
        with _open_text(path) as handle:
            return handle.read()
    except UnicodeDecodeError as err:
        raise CalibrationDataError(
            f"calibration data {path} is not UTF-8 text (byte {err.start}: {err.reason}); {_SOURCES}"
        ) from err
    except OSError as err:
        raise CalibrationDataError(f"calibration data {path}: cannot read it: {err}") from err


def _json_texts(path: Path) -> list[str]:
    try:
        data = json.loads(_read(path))
    except json.JSONDecodeError as err:
        raise CalibrationDataError(
            f"calibration data {path}: not valid JSON (line {err.lineno}, column {err.colno}: "
            f"{err.msg}); expected a list of strings"
        ) from err
    except RecursionError as err:
        raise CalibrationDataError(
            f"calibration data {path}: the JSON is nested too deeply to parse; "
            "expected a list of strings"
        ) from err
    if not isinstance(data, list):
        raise CalibrationDataError(
            f"calibration data {path} holds a JSON {type(data).__name__}; expected a list of strings"
        )
    for index, item in enumerate(data):
        if not isinstance(item, str):
            raise CalibrationDataError(
                f"calibration data {path}: item {index} is a {type(item).__name__}, "
                "expected a string; the file must hold a list of strings"
            )
    return list(data)


def _dataset_texts(path: Path, samples: int | None) -> list[str]:
    if not any((path / marker).is_file() for marker in _DATASET_MARKERS):
        raise CalibrationDataError(
            f"calibration data {path} is a directory without {' or '.join(_DATASET_MARKERS)}, "
            f"so not a dataset saved by datasets' save_to_disk; {_SOURCES}"
        )
    try:
        import datasets
    except ImportError as err:
        raise CalibrationDataError(
            f"calibration data {path} is a dataset saved with save_to_disk, and reading it "
            "needs the `datasets` package: run `pip install datasets`, or pass the texts "
            "as a text file or a JSON list instead"
        ) from err
    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        dataset = dataset[_pick_split(path, list(dataset))]
    column = _pick_column(path, dataset.features)
    count = len(dataset) if samples is None else min(samples * 2, len(dataset))
    # Read twice the samples asked for, so that a few blank rows still leave enough.
    return [t for t in dataset.select(range(count))[column] if isinstance(t, str)]


def _pick_split(path: Path, splits: list[str]) -> str:
    if "train" in splits:
        return "train"
    if len(splits) == 1:
        return splits[0]
    raise CalibrationDataError(
        f"calibration data {path} is a DatasetDict with splits {', '.join(sorted(splits))} "
        "and none named 'train'; save the split to use with Dataset.save_to_disk"
    )


def _pick_column(path: Path, features: Any) -> str:
    strings = [
        str(name)
        for name, feature in features.items()
        if getattr(feature, "dtype", None) in _STRING_DTYPES
    ]
    if "text" in strings:
        return "text"
    if len(strings) == 1:
        return strings[0]
    described = ", ".join(f"{name} ({feature})" for name, feature in features.items())
    reason = "several string columns" if strings else "no string column"
    raise CalibrationDataError(
        f"calibration data {path} has {reason} and none named 'text': {described}; "
        "rename the column to use to 'text' (dataset.rename_column) and save it again"
    )


def load_local_tokenizer(model_dir: str | Path) -> Any | None:
    """The tokenizer saved in ``model_dir``, or ``None`` when the directory has no tokenizer file.

    Loads with ``transformers.AutoTokenizer`` from local files only, with
    ``trust_remote_code=False``; never downloads, never prompts. A directory that
    has tokenizer files (:data:`TOKENIZER_FILES`) that fail to load raises
    :class:`CalibrationDataError` rather than falling back silently to byte ids;
    one holding a FIFO, device or socket raises it too, before anything is opened.
    A directory whose tokenizer (or model) would run code of its own (``auto_map``,
    ``*.py``) raises :class:`~exportlm.errors.CustomCodeRefusedError`.
    """
    directory = Path(model_dir)
    if not any((directory / name).exists() for name in TOKENIZER_FILES):
        return None
    try:
        ensure_no_special_files(directory, what="tokenizer directory")
    except NotRegularFileError as err:
        raise CalibrationDataError(f"{err} Remove it, or the tokenizer files.") from err
    refuse_custom_code(directory)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            directory, local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError, KeyError, ImportError) as err:
        raise CalibrationDataError(
            f"{directory} has tokenizer files but transformers cannot load them: {err}; "
            "fix or remove them (without a tokenizer, calibration uses UTF-8 byte ids)"
        ) from err


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
    import torch

    stream = _token_stream(texts, tokenizer, vocab_size)
    rows = [stream[i : i + seq_len] for i in range(0, len(stream), seq_len)]
    full = [row for row in rows if len(row) == seq_len]
    batches = [
        torch.tensor(full[i : i + batch_size], dtype=torch.long)
        for i in range(0, len(full), batch_size)
    ]
    if len(rows) > len(full):
        batches.append(torch.tensor([rows[-1]], dtype=torch.long))
    return batches


def _token_stream(texts: Sequence[str], tokenizer: Any | None, vocab_size: int) -> list[int]:
    if tokenizer is None:
        separator = utf8_byte_ids("\n", vocab_size)
        encoded = [utf8_byte_ids(text, vocab_size) for text in texts]
    else:
        eos = getattr(tokenizer, "eos_token_id", None)
        separator = [eos] if isinstance(eos, int) else []
        encoded = [list(tokenizer(text)["input_ids"]) for text in texts]
    stream: list[int] = []
    for index, ids in enumerate(encoded):
        if index:
            stream.extend(separator)
        stream.extend(ids)
    too_large = max(stream, default=0)
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
    """
    if not batches:
        raise CalibrationDataError("calibrate_with needs at least one batch")

    def calibrate(model: nn.Module) -> None:
        import torch

        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        lean = _lean_forward_kwargs(model)
        with torch.no_grad():
            for batch in progress(batches, desc, total=len(batches), unit="batch"):
                model(batch.to(device), **lean)

    return calibrate


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
