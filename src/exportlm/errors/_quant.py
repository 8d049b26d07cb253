"""Errors of quantization formats: unsupported, unclaimed, tied, unknown algorithms."""

from __future__ import annotations

from exportlm.errors._base import ExportLMError
from exportlm.errors._export import ExportError
from exportlm.errors._inputs import MalformedCheckpointError

__all__ = [
    "DistributedCalibrationError",
    "InvalidRecipeError",
    "QuantizationError",
    "TiedWeightsError",
    "UnclaimedModuleError",
    "UnknownQuantAlgoError",
    "UnsupportedFormatError",
]


class QuantizationError(ExportLMError):
    """Base class of fake-quantization and quantized-export errors."""


class DistributedCalibrationError(QuantizationError):
    """The ranks of a ``torch.distributed`` process group calibrated different models or
    recipes (their statistics cannot be combined), or a collective that failed."""


class UnsupportedFormatError(QuantizationError, ValueError):
    """A quantization format cannot be applied to a module or tensor of this shape."""


class InvalidRecipeError(QuantizationError, ValueError):
    """A quantization recipe that does not parse or asks for what cannot be: an empty part
    (``'fp8+'``), options not spelled ``KEY=VALUE``, an option's value out of its range, two
    weight algorithms in one recipe. The message says what is accepted; the command line
    exits with its usage code. (An unknown recipe or option name is an
    :class:`~exportlm.errors.UnknownNameError` / :class:`~exportlm.errors.UnknownOptionError`.)
    """


class UnclaimedModuleError(QuantizationError, ExportError):
    """A quantized module was not claimed by any registered module exporter."""


class TiedWeightsError(QuantizationError, ExportError):
    """Tensors declared tied hold different values."""


class UnknownQuantAlgoError(MalformedCheckpointError, UnsupportedFormatError):
    """A checkpoint declares a ``quant_algo`` (or scheme) that no registered format and no
    known loader has: the checkpoint is malformed for this exportlm, and the format is
    unsupported until one is registered (``exportlm.quant.formats.register_format``).
    """
