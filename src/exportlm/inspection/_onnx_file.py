"""Reading an ONNX file that came from elsewhere with bounded memory.

An ONNX model is one protobuf message, and protobuf cannot hold more than 2 GiB:
larger models keep their weights in external-data files beside the ``.onnx``
file. So a ``.onnx`` file larger than :data:`MAX_ONNX_BYTES` is not an ONNX model
(a sparse or padded file would otherwise be read whole: 16 GiB for a sparse
16 GiB file), and it is refused by its size, before a byte is read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from exportlm.errors import InputTooLargeError, MissingDependencyError
from exportlm.safeio import ensure_regular_file, read_regular_bytes

__all__ = ["MAX_ONNX_BYTES", "check_onnx_size", "read_onnx_model"]

#: The largest ``.onnx`` file read: protobuf's limit on one message (2 GiB - 1).
MAX_ONNX_BYTES = (1 << 31) - 1


def _too_large(path: Path, size: int) -> InputTooLargeError:
    return InputTooLargeError(
        f"ONNX file {path} has {size} bytes, more than the {MAX_ONNX_BYTES} an ONNX model "
        "can hold (protobuf's 2 GiB limit; larger models keep their weights in external-data "
        "files beside the .onnx file), so it is not an ONNX model and is not read; "
        "re-export it with external data",
        what="ONNX file",
        size=size,
        limit=MAX_ONNX_BYTES,
    )


def check_onnx_size(path: str | os.PathLike[str]) -> Path:
    """``path`` when it is a regular file of at most :data:`MAX_ONNX_BYTES` (nothing is read).

    For a library that opens the file by path itself (onnxruntime, ``onnx.checker``).
    Raises :class:`~exportlm.errors.InputTooLargeError`,
    :class:`~exportlm.errors.NotRegularFileError` or ``FileNotFoundError``.
    """
    file = ensure_regular_file(path, what="ONNX file")
    size = file.stat().st_size
    if size > MAX_ONNX_BYTES:
        raise _too_large(file, size)
    return file


def read_onnx_model(path: str | os.PathLike[str]) -> Any:
    """The ``onnx.ModelProto`` of ``path``, its external data not loaded.

    The file is opened once (a FIFO or device refused before a byte is read), its
    size checked on that descriptor, and at most :data:`MAX_ONNX_BYTES` read.
    Raises :class:`~exportlm.errors.InputTooLargeError` for a larger file,
    :class:`~exportlm.errors.MissingDependencyError` without ``onnx``, and what
    protobuf raises for bytes that are not a model (``DecodeError``).
    """
    try:
        import onnx
    except ImportError as err:
        raise MissingDependencyError(["onnx"], "onnx", "reading an ONNX file") from err
    file = Path(path)
    try:
        data = read_regular_bytes(file, what="ONNX file", max_bytes=MAX_ONNX_BYTES)
    except InputTooLargeError as err:
        raise _too_large(file, err.size or 0) from err
    return onnx.load_model_from_string(data)
