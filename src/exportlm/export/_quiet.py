"""Exporter noise control shared by the export targets.

``torch.onnx`` prints progress lines and logs one ``torchvision is not installed``
warning per torchvision op on every dynamo export; ``torch.jit`` and the legacy
ONNX exporter raise deprecation warnings and one ``TracerWarning`` per traced
Python value; transformers emits ``FutureWarning``\\ s from inside its own
forward. A user exporting a model wants none of that flood, but does want the
warnings that are about *their* model.

:func:`quiet_exporter` captures all of it for the duration of one export and
then:

* re-emits every warning that is not known exporter noise, unchanged;
* counts the noise (suppressed warnings, printed lines, library log records) and
  logs **one** ``INFO`` line on the ``exportlm.export`` logger naming how much
  was hidden; the full text is logged at ``DEBUG``;
* hands the caller a :class:`CapturedNoise` so a target can turn a category of
  noise into one warning of its own (e.g. one deprecation warning per
  TorchScript export instead of two dozen).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from warnings import WarningMessage

__all__ = ["CapturedNoise", "quiet_exporter", "warn_caller"]

logger = logging.getLogger("exportlm.export")

#: Library loggers that chatter during an export; raised to ERROR while exporting.
_NOISY_LOGGERS = (
    "torch.onnx",
    "torch.export",
    "torch._export",
    "torch.fx.experimental.symbolic_shapes",
    "torch._dynamo",
    "onnxscript",
    "onnx_ir",
    "transformers",
)
#: torch's structured-trace logger (for ``tlparse``): every graph and guard at DEBUG, which
#: a test runner's log capture prints under each item. Left alone when the user asked for
#: a trace (``TORCH_TRACE``).
_TRACE_LOGGER = "torch.__trace"


def _noisy_loggers() -> tuple[str, ...]:
    return _NOISY_LOGGERS if os.environ.get("TORCH_TRACE") else (*_NOISY_LOGGERS, _TRACE_LOGGER)


@dataclass
class CapturedNoise:
    """What one export printed and warned, collected by :func:`quiet_exporter`."""

    warnings: list[WarningMessage] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""

    def of_category(self, category: type[Warning]) -> list[WarningMessage]:
        """The captured warnings that are instances of ``category``."""
        return [w for w in self.warnings if issubclass(w.category, category)]


def _is_library_noise(message: WarningMessage) -> bool:
    """Deprecation chatter and tracer notes.

    During an export nothing but the exporter and the model's forward runs; a
    deprecation the forward itself triggers also fires in the user's eager runs,
    so every ``DeprecationWarning`` / ``FutureWarning`` / ``TracerWarning`` seen
    here is about library internals (torch.jit, torch.onnx, pytree, transformers).
    """
    category = message.category
    return category.__name__ == "TracerWarning" or issubclass(
        category, (DeprecationWarning, FutureWarning)
    )


@contextlib.contextmanager
def _quiet_loggers(names: tuple[str, ...]) -> Iterator[None]:
    saved = [(logging.getLogger(n), logging.getLogger(n).level) for n in names]
    for log, _ in saved:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in saved:
            log.setLevel(level)


@contextlib.contextmanager
def quiet_exporter(target: str) -> Iterator[CapturedNoise]:
    """Capture exporter output for one export of ``target``; see the module docstring.

    Warnings that are not library noise are re-emitted when the block exits, also
    when it raises. Library noise is dropped after being counted in one log line,
    except what the caller consumes from the yielded :class:`CapturedNoise`.
    """
    captured = CapturedNoise()
    out, err = io.StringIO(), io.StringIO()
    try:
        with (
            warnings.catch_warnings(record=True) as records,
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            _quiet_loggers(_noisy_loggers()),
        ):
            warnings.simplefilter("always")
            captured.warnings = records  # the live list: a target can inspect it mid-export
            try:
                yield captured
            finally:
                captured.warnings = list(records)
                captured.stdout, captured.stderr = out.getvalue(), err.getvalue()
    finally:
        _report(target, captured)


def _report(target: str, captured: CapturedNoise) -> None:
    noise = [w for w in captured.warnings if _is_library_noise(w)]
    for w in captured.warnings:
        if not _is_library_noise(w):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    lines = [line for line in (captured.stdout + captured.stderr).splitlines() if line.strip()]
    if noise or lines:
        logger.info(
            "%s export: hid %d exporter output line(s) and %d library warning(s); "
            "enable DEBUG logging for 'exportlm.export' to see them",
            target,
            len(lines),
            len(noise),
        )
    if logger.isEnabledFor(logging.DEBUG):
        for line in lines:
            logger.debug("%s exporter output: %s", target, line)
        for w in noise:
            logger.debug("%s exporter warning: %s: %s", target, w.category.__name__, w.message)


#: ``.../exportlm/`` with the separator, so a sibling such as ``exportlm_plugin/`` is not inside.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def warn_caller(warning: Warning) -> None:
    """Emit ``warning`` attributed to the first frame outside exportlm (the user's call).

    Walks the stack with :func:`inspect.currentframe` (``warnings.warn``'s own
    ``skip_file_prefixes`` does this, but only from Python 3.12). Where the
    interpreter has no frame support the warning points at exportlm itself.
    """
    level = 1
    frame = inspect.currentframe()
    caller = frame.f_back if frame is not None else None
    del frame  # no reference cycle through this frame
    while caller is not None and os.path.abspath(caller.f_code.co_filename).startswith(
        _PACKAGE_DIR
    ):
        level, caller = level + 1, caller.f_back
    del caller
    warnings.warn(warning, stacklevel=level + 1)
