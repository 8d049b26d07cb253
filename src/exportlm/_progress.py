"""Progress reporting: a tqdm bar on a terminal, log lines everywhere else.

Two calls cover what exportlm can show while it works:

* :func:`progress` wraps an iterable whose length is known (calibration
  batches, modules, shards): a tqdm bar on a terminal; otherwise a ``DEBUG``
  line per item and an ``INFO`` line every :data:`LOG_EVERY_S` seconds, so a
  long loop in CI still shows it is alive.
* :func:`phase` wraps one step whose inside cannot be seen (tracing, an ONNX
  export): it logs ``"<desc>..."`` at ``INFO`` and, on a terminal, shows a
  spinner with the elapsed time until the step ends.

Bars and spinners go to standard error, and only when it is a terminal, the
``CI`` environment variable is unset (or ``0`` / ``false``), tqdm is importable
and no :func:`override_progress` turned them off (the command line's ``-q``).
tqdm is imported lazily, the first time a bar is shown. Log lines go to the
``exportlm.progress`` logger.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import IO, Any, TypeVar

__all__ = [
    "LOG_EVERY_S",
    "override_progress",
    "phase",
    "progress",
    "progress_enabled",
    "write_line",
]

T = TypeVar("T")

logger = logging.getLogger("exportlm.progress")

#: Seconds between two ``INFO`` progress lines when no bar is shown.
LOG_EVERY_S = 10.0
_SPINNER_FRAMES = "|/-\\"
_SPIN_INTERVAL_S = 0.1
_CI_OFF_VALUES = ("", "0", "false", "no", "off")


@dataclass
class _Settings:
    enabled: bool | None = None  # None: decide from the stream and the environment
    stream: IO[str] | None = None  # None: sys.stderr at the time a bar starts


_settings = _Settings()
_active_bars = 0
_bars_lock = threading.Lock()


def _stream() -> IO[str]:
    return _settings.stream if _settings.stream is not None else sys.stderr


def progress_enabled() -> bool:
    """True when bars and spinners are shown now (see the module docstring for the rules)."""
    if _settings.enabled is not None:
        return _settings.enabled and _tqdm_class() is not None
    if os.environ.get("CI", "").strip().lower() not in _CI_OFF_VALUES:
        return False
    isatty = getattr(_stream(), "isatty", None)
    return bool(isatty and isatty()) and _tqdm_class() is not None


@contextlib.contextmanager
def override_progress(enabled: bool | None, stream: IO[str] | None = None) -> Iterator[None]:
    """Within the block, force bars on (``True``) or off (``False``), or decide (``None``).

    ``stream`` is where bars go (default: ``sys.stderr`` when a bar starts). The
    command line binds it to the real standard error, so a bar stays visible
    while an exporter's own output is being captured. Settings are restored on exit.
    """
    saved = (_settings.enabled, _settings.stream)
    _settings.enabled, _settings.stream = enabled, stream
    try:
        yield
    finally:
        _settings.enabled, _settings.stream = saved


def _tqdm_class() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


def progress(
    iterable: Iterable[T], desc: str, total: int | None = None, *, unit: str = "it"
) -> Iterator[T]:
    """Yield from ``iterable`` while reporting progress as ``desc`` (e.g. ``"calibrating"``).

    ``total`` defaults to ``len(iterable)`` when it has one. A bar on a
    terminal; otherwise log lines (see the module docstring). The bar is removed
    when the loop ends, also when it ends early or raises.
    """
    if total is None and isinstance(iterable, Sized):
        total = len(iterable)
    if progress_enabled():
        yield from _bar(iterable, desc, total, unit)
        return
    start = last = time.monotonic()
    for index, item in enumerate(iterable, 1):
        yield item
        now = time.monotonic()
        count = f"{index}/{total}" if total is not None else str(index)
        logger.debug("%s: %s %s", desc, count, unit)
        if now - last >= LOG_EVERY_S:
            logger.info("%s: %s %s (%.0f s)", desc, count, unit, now - start)
            last = now


def _bar(iterable: Iterable[T], desc: str, total: int | None, unit: str) -> Iterator[T]:
    tqdm = _tqdm_class()
    with (
        _counted(),
        tqdm(
            iterable,
            desc=desc,
            total=total,
            unit=unit,
            file=_stream(),
            leave=False,
            dynamic_ncols=True,
        ) as bar,
    ):
        yield from bar


@contextlib.contextmanager
def phase(desc: str) -> Iterator[None]:
    """Report one step that cannot be broken into items: ``with phase("exporting to onnx"): ...``.

    Logs ``"<desc>..."`` at ``INFO`` when the step starts and its duration at
    ``DEBUG`` when it ends; on a terminal a spinner with the elapsed time runs
    below the line until then.
    """
    logger.info("%s...", desc)
    start = time.monotonic()
    spinner = _Spinner(desc) if progress_enabled() else None
    try:
        yield
    finally:
        if spinner is not None:
            spinner.stop()
        logger.debug("%s: done in %.2f s", desc, time.monotonic() - start)


class _Spinner:
    """A tqdm line ``| <desc> 00:03`` refreshed by a daemon thread until :meth:`stop`."""

    def __init__(self, desc: str) -> None:
        tqdm = _tqdm_class()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(_counted())
        self._bar = self._stack.enter_context(
            tqdm(
                total=None,
                desc=f"{_SPINNER_FRAMES[0]} {desc}",
                bar_format="{desc} {elapsed}",
                file=_stream(),
                leave=False,
                dynamic_ncols=True,
            )
        )
        self._desc = desc
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._spin, name="exportlm-spinner", daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        frame = 0
        while not self._done.wait(_SPIN_INTERVAL_S):
            frame += 1
            symbol = _SPINNER_FRAMES[frame % len(_SPINNER_FRAMES)]
            self._bar.set_description_str(f"{symbol} {self._desc}", refresh=True)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self._stack.close()


@contextlib.contextmanager
def _counted() -> Iterator[None]:
    global _active_bars
    with _bars_lock:
        _active_bars += 1
    try:
        yield
    finally:
        with _bars_lock:
            _active_bars -= 1


def write_line(stream: IO[str], text: str) -> None:
    """Write ``text`` and a newline to ``stream`` without garbling a bar that is showing.

    A log handler that writes where bars are drawn should write through this.
    """
    if _active_bars:
        tqdm = _tqdm_class()
        with tqdm.external_write_mode(file=stream):
            stream.write(text + "\n")
            stream.flush()
        return
    stream.write(text + "\n")
    stream.flush()
