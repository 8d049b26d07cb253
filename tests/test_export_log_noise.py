"""An export logs one line of its own, not torch's structured-trace records.

torch's dynamo-based exporters log every graph and guard on the ``torch.__trace``
logger at DEBUG (for ``tlparse``); pytest's log capture (``-rA``) printed ~130 such
lines under each passing item that exported. They are kept when the user asks for a
trace (``TORCH_TRACE``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from exportlm.export import export_model
from exportlm.models import build_model


def _trace_records(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> list[logging.LogRecord]:
    model = build_model("decoder", seed=0, num_layers=1)
    with caplog.at_level(logging.DEBUG):
        export_model("torch_export", model, tmp_path / "m.pt2")
    return [r for r in caplog.records if r.name.startswith("torch.__trace")]


def test_an_export_logs_no_structured_trace_records(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCH_TRACE", raising=False)
    level = logging.getLogger("torch.__trace").level
    assert _trace_records(caplog, tmp_path) == []
    assert logging.getLogger("torch.__trace").level == level  # restored after the export


def test_a_trace_the_user_asked_for_is_kept(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_TRACE", str(tmp_path / "trace"))
    assert _trace_records(caplog, tmp_path) != []
