"""A model directory's own tokenizer, loaded and called without letting it crash the process.

A ``tokenizer.json`` is untrusted input, and the Rust ``tokenizers`` library answers
some malformed ones (a post-processor naming a token the vocabulary lacks) with a
panic: ``pyo3_runtime.PanicException``, a :class:`BaseException` that ``except
Exception`` does not catch, raised when the tokenizer is loaded or only when it
first encodes. Both are wrapped here: any failure but an interpreter's own
(``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit``) becomes a
:class:`~exportlm.calibration.CalibrationDataError` naming the directory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from exportlm.calibration._common import CalibrationDataError
from exportlm.errors import ExportLMError, NotRegularFileError
from exportlm.hfdir import refuse_custom_code
from exportlm.safeio import ensure_no_special_files

__all__ = ["TOKENIZER_FILES", "encode", "load_local_tokenizer"]

#: Files whose presence in a model directory means it ships a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
#: What a tokenizer failure must never swallow: the interpreter's own exits.
_PASS_THROUGH = (KeyboardInterrupt, SystemExit, GeneratorExit)


def load_local_tokenizer(model_dir: str | Path) -> Any | None:
    """The tokenizer saved in ``model_dir``, or ``None`` when the directory has no tokenizer file.

    Loads with ``transformers.AutoTokenizer`` from local files only, with
    ``trust_remote_code=False``; never downloads, never prompts. A directory that
    has tokenizer files (:data:`TOKENIZER_FILES`) that fail to load, for any
    reason (a Rust panic of ``tokenizers`` included), raises
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

    with _tokenizer_errors(
        f"{directory} has tokenizer files but transformers cannot load them",
        "fix or remove them (without a tokenizer, calibration uses UTF-8 byte ids)",
    ):
        return AutoTokenizer.from_pretrained(
            directory, local_files_only=True, trust_remote_code=False
        )


def encode(tokenizer: Any, text: str, index: int) -> list[int]:
    """The token ids of calibration text ``index`` (special tokens included)."""
    with _tokenizer_errors(
        f"the model's tokenizer failed on calibration text {index}",
        "its tokenizer files are malformed: fix or remove them (without a tokenizer, "
        "calibration uses UTF-8 byte ids)",
    ):
        return list(tokenizer(text)["input_ids"])


@contextlib.contextmanager
def _tokenizer_errors(what: str, todo: str) -> Iterator[None]:
    try:
        yield
    except _PASS_THROUGH:
        raise
    except ExportLMError:
        raise
    except BaseException as err:  # tokenizers panics with a BaseException
        raise CalibrationDataError(f"{what}: {type(err).__name__}: {err}; {todo}") from err
