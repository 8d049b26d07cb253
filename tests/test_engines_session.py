"""Kept workers (exportlm.engines.session): one engine process serves run after run, and
a crash, a timeout or a one-shot worker never leaks into the next run."""

from __future__ import annotations

from pathlib import Path

import pytest

from exportlm.engines import (
    WORKERS_DIR,
    Engine,
    EngineCrashedError,
    EngineRefusedError,
    EngineRequest,
    EngineTimeoutError,
    run_engine,
)

# The worker answers with its own process id as every token: which process served it.
PID_WORKER = f"""
import os, sys, time
sys.path.insert(0, {str(WORKERS_DIR)!r})
import _worker

def serve(ctx):
    mode = ctx.options(["mode"]).get("mode", "ok")
    if mode == "refuse":
        raise ValueError("no kernel for this scheme")
    if mode == "crash":
        os._exit(7)
    if mode == "hang":
        time.sleep(120)
    rows = _worker.rows(ctx.request)
    n = ctx.request["max_new_tokens"]
    return [[os.getpid()] * n for _ in rows], [[-1.0] * (len(r) - 1) for r in rows]

sys.exit(_worker.main("pid", "json", ("pytest",), serve))
"""


def _engine(tmp_path: Path, text: str = PID_WORKER, name: str = "pid") -> Engine:
    worker = tmp_path / f"{name}_worker.py"
    worker.write_text(text)
    return Engine(name=name, module="json", distributions=("pytest",), worker=str(worker))


def _pid(engine: Engine, artifact: Path, **options: str) -> int:
    request = EngineRequest.left_padded([[1, 2, 3], [4]], max_new_tokens=2, options=options)
    return run_engine(engine, artifact, request, timeout=60).tokens[0][0]


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    (tmp_path / "artifact").mkdir()  # a folder of its own: no worker .py beside it
    path = tmp_path / "artifact" / "model.onnx"
    path.write_bytes(b"not read")
    return path


def test_one_worker_process_serves_run_after_run(tmp_path: Path, artifact: Path) -> None:
    engine = _engine(tmp_path)
    first = _pid(engine, artifact)
    assert _pid(engine, artifact) == first
    with pytest.raises(EngineRefusedError, match="no kernel"):
        _pid(engine, artifact, mode="refuse")
    assert _pid(engine, artifact) == first  # a refusal is an answer: the worker stays


def test_the_opt_out_runs_each_request_in_a_process_of_its_own(
    tmp_path: Path, artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXPORTLM_ENGINE_REUSE", "0")
    engine = _engine(tmp_path)
    assert _pid(engine, artifact) != _pid(engine, artifact)


def test_another_environment_gets_another_worker(
    tmp_path: Path, artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(tmp_path)
    first = _pid(engine, artifact)
    monkeypatch.setenv("EXPORTLM_TEST_SESSION_KEY", "another")
    assert _pid(engine, artifact) != first


def test_after_a_crash_or_a_timeout_the_next_run_gets_a_fresh_worker(
    tmp_path: Path, artifact: Path
) -> None:
    engine = _engine(tmp_path)
    first = _pid(engine, artifact)
    with pytest.raises(EngineCrashedError) as info:
        _pid(engine, artifact, mode="crash")
    assert info.value.returncode == 7
    second = _pid(engine, artifact)
    assert second != first
    request = EngineRequest.left_padded([[1, 2]], max_new_tokens=1, options={"mode": "hang"})
    with pytest.raises(EngineTimeoutError):
        run_engine(engine, artifact, request, timeout=3)
    assert _pid(engine, artifact) not in (first, second)


def test_a_one_shot_worker_still_answers_each_run(tmp_path: Path, artifact: Path) -> None:
    """A worker that ignores ``--more`` (answers its command line and exits): a process a run."""
    answer = {"protocol": 1, "status": "ok", "engine_version": "1", "tokens": [[9], [9]]}
    answer["logprobs"] = [[-1.0, -1.0], []]
    text = f"import json, sys\nopen(sys.argv[2], 'w').write(json.dumps({answer!r}))\n"
    engine = _engine(tmp_path, text, name="oneshot")
    request = EngineRequest.left_padded([[1, 2, 3], [4]], max_new_tokens=1)
    for _ in range(2):
        assert run_engine(engine, artifact, request, timeout=60).tokens == [[9], [9]]


def test_the_running_tests_name_is_not_part_of_the_key(
    tmp_path: Path, artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(tmp_path)
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/a.py::one (call)")
    first = _pid(engine, artifact)
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/a.py::two (call)")
    assert _pid(engine, artifact) == first
