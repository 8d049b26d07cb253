"""Calibration texts from a text file (one sample per line) or a ``.json`` list of strings.

Both are read with bounded memory: a text file in chunks, one line at a time, no
line longer than :data:`~exportlm.calibration.MAX_SAMPLE_BYTES` and no further
than the samples asked for; a ``.json`` file only when it holds at most
:data:`~exportlm.calibration.MAX_JSON_BYTES` (judged by its size before a byte is read).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from exportlm.calibration._common import (
    MAX_JSON_BYTES,
    MAX_SAMPLE_BYTES,
    SOURCES,
    CalibrationDataError,
)
from exportlm.errors import InputTooLargeError, NotRegularFileError
from exportlm.safeio import open_regular, read_regular_bytes

__all__ = ["json_texts", "text_lines"]

_CHUNK = 1 << 16
#: UTF-8's byte order mark, which some editors put at the start of a text file.
_BOM = b"\xef\xbb\xbf"


def text_lines(path: Path, samples: int | None) -> list[str]:
    """The first ``samples`` non-blank lines (all of them for ``None``), read in chunks."""
    lines: list[str] = []
    try:
        with open_regular(path, what="calibration data") as handle:
            for number, raw in _bounded_lines(handle, path):
                if number == 1:  # a byte order mark (Windows editors write one) is no text
                    raw = raw.removeprefix(_BOM)
                # universal newlines, as text mode reads them: \r\n, \r and \n end a line
                for part in raw.removesuffix(b"\r").split(b"\r"):
                    text = _decode(part, path, number)
                    if text.strip():
                        lines.append(text)
                if samples is not None and len(lines) >= samples:
                    break
    except NotRegularFileError as err:
        raise CalibrationDataError(f"{err} ({SOURCES})") from err
    except OSError as err:
        raise CalibrationDataError(f"calibration data {path}: cannot read it: {err}") from err
    return lines


def _bounded_lines(handle: BinaryIO, path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes without the newline) of each line; none longer than the bound."""
    pending = bytearray()
    number = 1
    while chunk := handle.read(_CHUNK):
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            pending += chunk[start:end]
            _check_length(len(pending) - pending.endswith(b"\r"), number, path, handle)
            yield number, bytes(pending)
            pending.clear()
            number += 1
            start = end + 1
        pending += chunk[start:]
        _check_length(len(pending) - 1, number, path, handle)  # a \r may end it
    if pending:
        _check_length(len(pending), number, path, handle)
        yield number, bytes(pending)


def _check_length(length: int, number: int, path: Path, handle: BinaryIO) -> None:
    """Refuse line ``number`` once its ``length`` (without a carriage return) is over the bound."""
    if length <= MAX_SAMPLE_BYTES:
        return
    size = os.fstat(handle.fileno()).st_size
    raise CalibrationDataError(
        f"calibration data {path}: line {number} is longer than {MAX_SAMPLE_BYTES} bytes "
        f"(the file has {size} bytes, read {handle.tell()} so far); a calibration sample is "
        f"one line of at most {MAX_SAMPLE_BYTES} bytes (MAX_SAMPLE_BYTES): split the text "
        "into lines, one sample per line"
    )


def _decode(raw: bytes, path: Path, number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CalibrationDataError(
            f"calibration data {path} is not UTF-8 text (line {number}, byte {err.start}: "
            f"{err.reason}); {SOURCES}"
        ) from err


def json_texts(path: Path) -> list[str]:
    """The strings of the ``.json`` file ``path`` (a list of strings, at most the byte bound)."""
    data = _parse(path, _read_json_text(path))
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


def _read_json_text(path: Path) -> str:
    try:
        data = read_regular_bytes(path, what="calibration data", max_bytes=MAX_JSON_BYTES)
        return data.removeprefix(_BOM).decode("utf-8")
    except NotRegularFileError as err:
        raise CalibrationDataError(f"{err} ({SOURCES})") from err
    except InputTooLargeError as err:
        raise CalibrationDataError(
            f"calibration data {path} has {err.size} bytes, more than the {MAX_JSON_BYTES} a "
            ".json file is read whole with (MAX_JSON_BYTES); put a large corpus in a text file, "
            "one sample per line: only the lines the samples need are read"
        ) from err
    except UnicodeDecodeError as err:
        raise CalibrationDataError(
            f"calibration data {path} is not UTF-8 text (byte {err.start}: {err.reason}); {SOURCES}"
        ) from err
    except OSError as err:
        raise CalibrationDataError(f"calibration data {path}: cannot read it: {err}") from err


def _parse(path: Path, text: str) -> object:
    try:
        return json.loads(text)
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
