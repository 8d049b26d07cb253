"""A streaming export killed after layer k continues from there and writes the same bytes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from exportlm.stream import export_streaming
from tests._stream_models import different_files, llama_directory

MANIFEST = "exportlm-manifest.json"

#: Runs the export and SIGKILLs itself when the log says layer KILL_AFTER is done.
_CHILD = textwrap.dedent(
    """
    import logging, os, signal, sys
    from exportlm.stream import export_streaming

    src, out, recipe, kill_after = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

    class Kill(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith(f"layer {kill_after} done"):
                os.kill(os.getpid(), signal.SIGKILL)

    logger = logging.getLogger("exportlm.stream")
    logger.setLevel(logging.INFO)
    logger.addHandler(Kill())
    export_streaming(src, out, recipe=recipe, max_shard_size="100KB")
    """
)


# fp8+fp8_kv writes every tensor plain fp8 writes, and the k/v scales: plain fp8 adds no case.
@pytest.mark.parametrize("recipe", ["int4_awq", "fp8+fp8_kv"])
def test_a_killed_run_resumes_after_its_last_layer_and_writes_the_same_bytes(
    tmp_path: Path, recipe: str, caplog: pytest.LogCaptureFixture
) -> None:
    src = llama_directory(tmp_path, tied=False, layers=4)
    whole = export_streaming(src, tmp_path / "whole", recipe=recipe, max_shard_size="100KB")
    out = tmp_path / "resumed"
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src), str(out), recipe, "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert not out.exists()  # nothing published by the killed run
    (work,) = tmp_path.glob(".resumed.stream-*")  # the killed run's private work area
    progress = json.loads((work / "progress.json").read_text())["record"]
    assert progress["layers_done"] == 2  # layers 0 and 1 were recorded
    with caplog.at_level("INFO", logger="exportlm.stream"):
        export_streaming(src, out, recipe=recipe, max_shard_size="100KB")
    assert "resuming after layer 2 of 4" in caplog.text
    assert "layer 0 done" not in caplog.text
    assert "layer 1 done" not in caplog.text
    assert different_files(whole, out, skip=(MANIFEST,)) == []
    assert not list(tmp_path.glob(".resumed.stream*"))


def test_other_arguments_start_afresh(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = llama_directory(tmp_path, tied=False, layers=2)
    out = tmp_path / "out"
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src), str(out), "int8_wo", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert len(list(tmp_path.glob(".out.stream-*"))) == 1
    with caplog.at_level("INFO", logger="exportlm.stream"):
        export_streaming(src, out, recipe="fp8", max_shard_size="100KB")
    assert "it was started with other arguments" in caplog.text
    assert "resuming after" not in caplog.text
    assert (out / "model.safetensors.index.json").is_file()
    assert not list(tmp_path.glob(".out.stream*"))  # the other run's area was removed too
