"""What the command line prints on standard error, by verbosity.

=========  ==========================================  ==================  ============
verbosity  exportlm's progress lines (cli, progress)   other exportlm      third party
=========  ==========================================  ==================  ============
``-q``     WARNING                                     WARNING             WARNING
default    INFO                                        WARNING             WARNING
``-v``     DEBUG                                       DEBUG               WARNING
``-vv``    DEBUG                                       DEBUG               DEBUG
=========  ==========================================  ==================  ============

Progress bars are shown only at the default verbosity and above (see
:mod:`exportlm._progress`). Python warnings become one ``warning:`` line each.
Everything is restored when the command returns, so :func:`exportlm.cli.main`
can be called repeatedly in one process (tests do).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import IO, Any

from exportlm._progress import override_progress, write_line

__all__ = ["PROG", "cli_output"]

PROG = "exportlm"
#: Loggers that narrate what the command does; INFO by default.
_NARRATORS = ("exportlm.cli", "exportlm.progress")


class _LineHandler(logging.Handler):
    """One line per record on ``stream``, written around any progress bar."""

    def __init__(self, stream: IO[str], verbose: bool) -> None:
        super().__init__()
        self.stream = stream
        self.verbose = verbose

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        level = record.levelname.lower()
        if not record.name.startswith("exportlm"):
            text = f"{record.name}: {level}: {message}"
        elif record.levelno == logging.INFO:
            text = f"{PROG}: {message}"
        elif self.verbose and record.name not in _NARRATORS:
            text = f"{PROG}: {level}: {record.name}: {message}"
        else:
            text = f"{PROG}: {level}: {message}"
        if record.exc_info and self.verbose:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        return text

    def emit(self, record: logging.LogRecord) -> None:
        try:
            write_line(self.stream, self.format(record))
        except Exception:
            self.handleError(record)


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    log = logging.getLogger("exportlm.cli")
    where = f" ({filename}:{lineno})" if log.isEnabledFor(logging.DEBUG) else ""
    log.warning("%s: %s%s", category.__name__, message, where)


@contextlib.contextmanager
def _saved_logging(names: tuple[str, ...]) -> Iterator[None]:
    root = logging.getLogger()
    loggers = [logging.getLogger(name) for name in names]
    saved_levels = [(log, log.level) for log in (root, *loggers)]
    saved_handlers = list(root.handlers)
    saved_showwarning = warnings.showwarning
    try:
        yield
    finally:
        warnings.showwarning = saved_showwarning
        root.handlers[:] = saved_handlers
        for log, level in saved_levels:
            log.setLevel(level)


@contextlib.contextmanager
def cli_output(verbosity: int, stream: IO[str]) -> Iterator[None]:
    """Configure logging, warnings and progress bars for one command (see the module docstring).

    ``verbosity`` is the number of ``-v`` minus the number of ``-q``; ``stream``
    is the real standard error, bound now so that lines and bars stay visible
    while an exporter's own output is captured.
    """
    with (
        _saved_logging(("exportlm", *_NARRATORS)),
        override_progress(False if verbosity < 0 else None, stream),
    ):
        root = logging.getLogger()
        root.addHandler(_LineHandler(stream, verbose=verbosity > 0))
        root.setLevel(logging.DEBUG if verbosity > 1 else logging.WARNING)
        logging.getLogger("exportlm").setLevel(logging.DEBUG if verbosity > 0 else logging.WARNING)
        narrate = logging.WARNING if verbosity < 0 else logging.INFO
        for name in _NARRATORS:
            logging.getLogger(name).setLevel(logging.DEBUG if verbosity > 0 else narrate)
        warnings.showwarning = _show_warning
        yield
