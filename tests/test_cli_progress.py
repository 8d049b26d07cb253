"""Progress reporting (``exportlm._progress``): bars on a terminal only, log lines elsewhere."""

from __future__ import annotations

import io
import logging
import sys
import threading
import time

import pytest

from exportlm import _progress
from exportlm._progress import override_progress, phase, progress, progress_enabled, write_line


class _Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> _Terminal:
    monkeypatch.delenv("CI", raising=False)
    return _Terminal()


def test_bars_need_a_terminal_and_no_ci(
    terminal: _Terminal, monkeypatch: pytest.MonkeyPatch
) -> None:
    with override_progress(None, terminal):
        assert progress_enabled()
        for value in ("true", "1", "yes"):
            monkeypatch.setenv("CI", value)
            assert not progress_enabled()
        for value in ("", "0", "false"):
            monkeypatch.setenv("CI", value)
            assert progress_enabled()
    with override_progress(None, io.StringIO()):
        assert not progress_enabled()
    with override_progress(False, terminal):
        assert not progress_enabled()
    with override_progress(True, io.StringIO()):
        assert progress_enabled()


def test_without_tqdm_there_is_no_bar(terminal: _Terminal, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    with override_progress(None, terminal):
        assert not progress_enabled()
        assert list(progress([1, 2], "calibrating")) == [1, 2]
    assert terminal.getvalue() == ""


def test_a_bar_on_a_terminal_shows_the_count_and_goes_away(terminal: _Terminal) -> None:
    with override_progress(None, terminal):
        assert list(progress(range(4), "calibrating", unit="batch")) == [0, 1, 2, 3]
    text = terminal.getvalue()
    assert "calibrating" in text
    assert "0/4 [" in text  # tqdm redraws at most every 0.1 s: the first frame is certain
    assert text.endswith("\r")  # leave=False: the line is cleared at the end


def test_without_a_terminal_progress_is_logged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = io.StringIO()
    caplog.set_level(logging.DEBUG, logger="exportlm.progress")
    monkeypatch.setattr(_progress, "LOG_EVERY_S", 0.0)  # an INFO line after every item
    with override_progress(None, stream):
        assert list(progress(iter("ab"), "calibrating", total=2, unit="batch")) == ["a", "b"]
    assert stream.getvalue() == ""
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert ("DEBUG", "calibrating: 1/2 batch") in messages
    assert ("INFO", "calibrating: 2/2 batch (0 s)") in messages


def test_a_phase_logs_and_spins_until_it_ends(
    terminal: _Terminal, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="exportlm.progress")
    with override_progress(None, terminal), phase("exporting to onnx"):
        time.sleep(0.35)
    assert "exporting to onnx" in terminal.getvalue()
    assert "exporting to onnx 00:00" in terminal.getvalue()
    assert not any(t.name == "exportlm-spinner" for t in threading.enumerate())
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "exporting to onnx..."
    assert messages[1].startswith("exporting to onnx: done in ")


def test_a_phase_that_raises_stops_its_spinner(terminal: _Terminal) -> None:
    with pytest.raises(ValueError, match="boom"), override_progress(None, terminal), phase("x"):
        raise ValueError("boom")
    assert not any(t.name == "exportlm-spinner" for t in threading.enumerate())


def test_a_line_written_during_a_bar_is_whole(terminal: _Terminal) -> None:
    with override_progress(None, terminal):
        for index in progress(range(2), "calibrating"):
            if index == 1:
                write_line(terminal, "exportlm: a log line")
    lines = terminal.getvalue().replace("\r", "\n").split("\n")
    assert "exportlm: a log line" in lines
