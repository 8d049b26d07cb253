"""What the calibration modules share: the error class, the accepted sources, the bounds."""

from __future__ import annotations

from exportlm.errors import ExportLMError

__all__ = ["MAX_JSON_BYTES", "MAX_SAMPLE_BYTES", "SOURCES", "CalibrationDataError"]

#: The longest line (one sample) read from a calibration text file: 1 MiB, about
#: 250,000 tokens, far beyond any calibration row. A longer line is refused with
#: its size, so a file without newlines is never read whole.
MAX_SAMPLE_BYTES = 1 << 20
#: The largest ``.json`` calibration file (it is parsed whole); larger corpora go
#: in a text file, one sample per line, read only as far as the samples asked for.
MAX_JSON_BYTES = 64 << 20

SOURCES = (
    "expected a text file (one sample per line), a .json file holding a list of strings, "
    "or a directory written by datasets' save_to_disk"
)


class CalibrationDataError(ExportLMError, ValueError):
    """Calibration data cannot be read, holds no usable samples, or does not fit the model."""
