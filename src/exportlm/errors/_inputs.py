"""Errors about files exportlm reads: special files, sizes, untrusted code, malformed or tampered artifacts, lock files."""

from __future__ import annotations

from exportlm.errors._base import ExportLMError

__all__ = [
    "ArtifactIntegrityError",
    "CustomCodeRefusedError",
    "InputTooLargeError",
    "MalformedCheckpointError",
    "MalformedOnnxError",
    "ManifestSchemaError",
    "NotRegularFileError",
    "UnsafeLockFileError",
    "UntrustedArtifactError",
]


class NotRegularFileError(ExportLMError, ValueError):
    """A path given to exportlm is not the kind of file expected (a FIFO, device or socket, usually).

    Raised before the path is opened for reading (a FIFO would block a reader
    forever, a device never ends). Attributes: ``path``, ``what`` (the role of the
    file, e.g. ``"calibration data"``), ``kind`` (what it is: ``"FIFO"``,
    ``"directory"``...) and ``expected`` (``"regular file"`` or ``"directory"``).
    """

    def __init__(self, path: object, what: str, kind: str, expected: str = "regular file") -> None:
        self.path = path
        self.what = what
        self.kind = kind
        self.expected = expected
        super().__init__(
            f"{what} {path} is a {kind}, not a {expected}; exportlm reads {what} only "
            f"from a {expected} (a FIFO or device could block or never end). "
            f"Pass the path of a {expected}."
        )


class InputTooLargeError(ExportLMError, ValueError):
    """An input over its size limit, refused before it is read or built: the message names
    the size, the limit and how to go on. Attributes: ``what``, ``size`` (or ``None``), ``limit``."""

    def __init__(self, message: str, *, what: str, size: int | None, limit: int) -> None:
        self.what, self.size, self.limit = what, size, limit
        super().__init__(message)


class UntrustedArtifactError(ExportLMError):
    """Loading the artifact could execute code, and nothing proves it was written here.

    Raised by :func:`exportlm.export.load_exported` before anything is read by the
    format's loader. The message names the file, the risk and the flag
    (``trust=True``; ``--trust`` on the command line).
    """


class CustomCodeRefusedError(UntrustedArtifactError):
    """A model directory needs Python code of its own (``auto_map``, ``*.py``) to load.

    exportlm never runs a checkpoint's code (it passes ``trust_remote_code=False``
    to every transformers call and never prompts). Raised before transformers is
    asked to read the directory. Attributes: ``path`` and ``reasons`` (what would
    have run).
    """

    def __init__(self, path: object, reasons: list[str]) -> None:
        self.path = path
        self.reasons = list(reasons)
        super().__init__(
            f"{path} needs code of its own to load ({'; '.join(self.reasons)}); exportlm never "
            "runs a checkpoint's code. Load the model yourself with code you have reviewed and "
            "pass the nn.Module to exportlm's Python API, or convert the checkpoint to an "
            "architecture that transformers ships (config.json without auto_map)."
        )


class MalformedCheckpointError(ExportLMError, ValueError):
    """A checkpoint file (config, index, safetensors header, tensor) is malformed.

    The message names the file and, where there is one, the field or tensor.
    Attributes: ``path`` (the file), ``field`` (the key or tensor name, or ``None``).
    """

    def __init__(self, message: str, path: object = None, field: str | None = None) -> None:
        self.path = path
        self.field = field
        super().__init__(message)


class MalformedOnnxError(MalformedCheckpointError):
    """An ONNX file onnxruntime would refuse: a custom-domain operator, external data outside
    its directory (by name or link), missing or truncated external data, an opset too old.

    Raised by the ``onnx`` runtime before onnxruntime creates a session, and for any
    error onnxruntime still raises creating one. ``field`` is the operator or initializer.
    """


class ArtifactIntegrityError(ExportLMError):
    """An artifact does not match its manifest (a file differs, is missing or is extra).

    Attributes:
        path: the file that differs, is missing or is extra (or the manifest itself).
    """

    def __init__(self, message: str, path: object = None) -> None:
        self.path = path
        super().__init__(message)


class ManifestSchemaError(ArtifactIntegrityError):
    """A manifest is unreadable: not JSON, or a schema version this exportlm does not know."""


class UnsafeLockFileError(ExportLMError):
    """A lock file's path is not a private regular file of this user (a symbolic link, ...).

    Lock files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and an existing one is
    opened only when it is a regular file this user owns with one link: a planted
    symbolic link would otherwise make the open create or lock the file it points to.
    Attributes: ``path`` and ``problem`` (what it is).
    """

    def __init__(self, path: object, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(
            f"lock file {path} is {problem}, not a private regular file of this user; it was "
            "not opened (a planted link would make the lock create or lock the file it points "
            f"to). Remove {path} if nobody else should have put it there."
        )
