"""Errors of an export: the model, its inputs, the output, the exporter, streaming."""

from __future__ import annotations

from exportlm.errors._base import ExportLMError

__all__ = [
    "DuplicateTensorError",
    "ExportError",
    "ExportFailedError",
    "InvalidInputError",
    "InvalidModelError",
    "InvalidOptionError",
    "LayerTooLargeError",
    "OutputExistsError",
    "RuntimeOutputError",
    "RuntimeUnavailableError",
    "StreamIntegrityError",
    "StreamingError",
    "StreamingUnsupportedError",
    "UnsupportedDtypeError",
    "UnsupportedOutputPathError",
]


class ExportError(ExportLMError):
    """Base class of errors raised while exporting."""


class ExportFailedError(ExportError):
    """The underlying exporter (torch.onnx, torch.jit, torch.export, ...) failed."""


class StreamingError(ExportError):
    """A layer-by-layer (streaming) export cannot proceed (:mod:`exportlm.stream`)."""


class StreamingUnsupportedError(StreamingError, ValueError):
    """The model family or recipe does not stream yet; the message names what, and the
    in-memory export to use instead."""


class LayerTooLargeError(StreamingError, MemoryError):
    """A streaming export does not fit its memory budget: the largest set of modules
    loaded at once (a decoder layer, the embedding), the output shard being filled and
    one linear in float32 need more than ``--max-memory`` / ``max_memory``."""


class StreamIntegrityError(StreamingError):
    """A streamed checkpoint does not hold together before it is published (a decoder layer or
    a module of the model missing from what was written): nothing is published, and the work
    area is removed so that the next run starts afresh."""

    def __init__(self, problem: str) -> None:
        self.problem = problem
        super().__init__(
            f"{problem}; nothing was published. The work area was changed outside this export "
            "or exportlm has a bug; it was removed, so exporting again starts afresh (report "
            "it if it happens again)"
        )


class RuntimeUnavailableError(ExportLMError, RuntimeError):
    """The requested runtime device (e.g. ``cuda``) is not available on this machine."""


class RuntimeOutputError(ExportError, TypeError):
    """A runtime returned something other than one logits tensor ``[batch, seq, vocab]``."""


class InvalidModelError(ExportError, TypeError):
    """The model does not have the shape an export target expects."""


class InvalidInputError(ExportError, TypeError):
    """Example inputs or runtime inputs are not what the target expects."""


class InvalidOptionError(InvalidInputError, ValueError):
    """An export target's option has a value the target does not take, or options that do
    not go together (``opset=0``, ``layout='bad'``, ``max_shard_size='abc'``); the message
    names the option and what it accepts. The command line exits with its usage code."""


class OutputExistsError(ExportError, FileExistsError):
    """The output path exists and overwriting was not requested."""


class UnsupportedOutputPathError(OutputExistsError):
    """The output path exists and is neither a regular file nor a directory (a device, FIFO, socket)."""


class UnsupportedDtypeError(InvalidInputError):
    """A dtype was asked that the target (or its runtime) cannot export or run."""


class DuplicateTensorError(ExportFailedError):
    """One checkpoint tensor name was written twice in one export.

    Raised by the export context and by the checkpoint sink; the message names the
    tensor and the module exporter (and module) that wrote it the second time.
    """
