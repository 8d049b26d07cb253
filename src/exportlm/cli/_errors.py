"""Exit codes of the command line and the errors that map to them."""

from __future__ import annotations

from exportlm.calibration import CalibrationDataError
from exportlm.errors import (
    ExportLMError,
    InputTooLargeError,
    InvalidConfigError,
    InvalidOptionError,
    InvalidRecipeError,
    NotRegularFileError,
    OutputExistsError,
    UnknownNameError,
    UnknownOptionError,
)

__all__ = ["EXIT_FAILURE", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "UsageError", "exit_code"]

#: The command did what was asked.
EXIT_OK = 0
#: The work failed: an export, a quantization or a verification.
EXIT_FAILURE = 1
#: The command line was wrong: arguments, option values, unknown names, missing paths,
#: a FIFO, device or socket given where a file is read, an input over its size limit.
EXIT_USAGE = 2
#: Interrupted with Ctrl-C (128 + SIGINT, as shells report it).
EXIT_INTERRUPTED = 130


class UsageError(ExportLMError, ValueError):
    """A command-line argument is wrong; the message names it and what is accepted."""


#: Errors that mean "the command line asked for something that does not exist or
#: cannot be": the same command will fail again until the user changes it.
_USAGE_ERRORS: tuple[type[BaseException], ...] = (
    UsageError,
    CalibrationDataError,
    UnknownNameError,
    UnknownOptionError,
    InvalidConfigError,
    InvalidOptionError,
    InvalidRecipeError,
    NotRegularFileError,
    OutputExistsError,
    InputTooLargeError,
)


def exit_code(error: BaseException) -> int:
    """:data:`EXIT_USAGE` for a usage error, :data:`EXIT_FAILURE` for anything else."""
    return EXIT_USAGE if isinstance(error, _USAGE_ERRORS) else EXIT_FAILURE
