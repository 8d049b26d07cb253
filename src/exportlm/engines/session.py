"""Worker processes kept between runs: an engine imported once serves run after run.

Importing an engine costs more than serving a toy model with it (vLLM CPU 0.32: about
11 CPU-s and 22 s wall at load 5 to import, 5-8 s to load a checkpoint and generate),
so :func:`exchange` keeps each worker that says it is ``reusable`` (``_worker.py``
with ``--more``) and hands it the next request for the same engine, interpreter and
environment. A worker that exits, crashes or times out is dropped (its process group
killed) and the next run starts a fresh one; so is the least recently used one past
:data:`MAX_SESSIONS`. ``EXPORTLM_ENGINE_REUSE=0`` runs every request in a process of
its own. Every kept worker is closed when this interpreter exits.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import signal
import subprocess
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = ["MAX_OUTPUT", "MAX_SESSIONS", "MORE", "TAIL_BYTES", "Exchange", "close_all", "exchange"]

#: The worker argument that keeps it serving requests from stdin (``_worker.MORE``).
MORE = "--more"
#: Workers kept at once (one per engine x interpreter x environment).
MAX_SESSIONS = 6
_POLL = 0.05
#: What one request's worker may write on stdout / stderr before it is killed (the log is
#: a file: only its last :data:`TAIL_BYTES` are ever read back, so memory stays bounded).
MAX_OUTPUT = 64 * 2**20
#: The end of the log read back for an error message.
TAIL_BYTES = 64 * 1024
_REUSE_ENV = "EXPORTLM_ENGINE_REUSE"
#: Environment variables that change between two runs without changing the engine's
#: (pytest names the running test in one): not part of a kept worker's key.
_VOLATILE = frozenset({"PYTEST_CURRENT_TEST"})


@dataclass
class Exchange:
    """One request's end: the worker's exit status (None: it runs on, or timed out)."""

    timed_out: bool
    code: int | None
    log: str
    response_path: Path
    #: the worker wrote more than ``max_output`` bytes of output and was killed
    flooded: bool = False


@dataclass
class _Session:
    proc: subprocess.Popen[bytes]
    tmp: tempfile.TemporaryDirectory[str]
    log: Path
    out: IO[bytes]
    count: itertools.count[int] = field(default_factory=itertools.count)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, kill: bool = False) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        if not kill:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                kill = True
        if kill:
            _kill_group(self.proc)
        self.out.close()
        self.tmp.cleanup()


_SESSIONS: OrderedDict[tuple[str, ...], _Session] = OrderedDict()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _reuse() -> bool:
    return os.environ.get(_REUSE_ENV, "1").strip() not in {"0", "false", "no", ""}


def _final(path: Path, limit: int) -> bool:
    """Whether the worker has written its last word on the request at ``path``.

    A response over ``limit`` bytes counts as its last word (the reader refuses it).
    """
    try:
        if path.stat().st_size > limit:
            return True
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(loaded, dict) and loaded.get("status") not in (None, "running")


def _start(
    name: str, cmd: Sequence[str], env: Mapping[str, str], tmp: tempfile.TemporaryDirectory[str]
) -> _Session:
    workdir = Path(tmp.name, "work")
    workdir.mkdir()
    log = Path(tmp.name, "log")
    out = open(log, "wb")  # noqa: SIM115 (closed with the session)
    proc = subprocess.Popen(
        list(cmd),
        cwd=workdir,
        env=dict(env),
        stdin=subprocess.PIPE,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return _Session(proc, tmp, log, out)


def _wait(session: _Session, resp: Path, timeout: float, start: int, max_output: int) -> Exchange:
    deadline = time.monotonic() + timeout
    code: int | None = None
    while True:
        code = session.proc.poll()
        if code is not None or _final(resp, max_output):
            break
        if session.log.stat().st_size - start > max_output:
            _kill_group(session.proc)
            return Exchange(False, None, _tail(session.log, start), resp, flooded=True)
        if time.monotonic() > deadline:
            _kill_group(session.proc)
            return Exchange(True, None, _tail(session.log, start), resp)
        time.sleep(_POLL)
    return Exchange(False, code, _tail(session.log, start), resp)


def _tail(log: Path, start: int) -> str:
    """The log from ``start``, at most its last :data:`TAIL_BYTES`."""
    with open(log, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        f.seek(max(start, end - TAIL_BYTES))
        return f.read(TAIL_BYTES).decode("utf-8", errors="replace")


def _paths(tmp: str, n: int) -> tuple[Path, Path]:
    return Path(tmp, f"request-{n}.json"), Path(tmp, f"response-{n}.json")


def _send(session: _Session, payload: Mapping[str, Any]) -> tuple[Path, int]:
    """Hand a kept worker its next request; the response path and the log's offset."""
    req, resp = _paths(session.tmp.name, next(session.count))
    req.write_text(json.dumps(payload), encoding="utf-8")
    start = session.log.stat().st_size
    assert session.proc.stdin is not None
    line = json.dumps({"request": str(req), "response": str(resp)}) + "\n"
    session.proc.stdin.write(line.encode("utf-8"))
    session.proc.stdin.flush()
    return resp, start


def _fresh(
    name: str, worker: Sequence[str], env: Mapping[str, str], payload: Mapping[str, Any]
) -> tuple[_Session, Path]:
    """A new worker, its first request on the command line (what a one-shot worker reads)."""
    tmp = tempfile.TemporaryDirectory(prefix=f"exportlm-engine-{name}-")
    req, resp = _paths(tmp.name, 0)
    req.write_text(json.dumps(payload), encoding="utf-8")
    cmd = [*worker, str(req), str(resp), *([MORE] if _reuse() else [])]
    session = _start(name, cmd, env, tmp)
    next(session.count)
    return session, resp


def exchange(
    name: str,
    worker: Sequence[str],
    env: Mapping[str, str],
    payload: Mapping[str, Any],
    timeout: float,
    read: Callable[[Path, str], dict[str, Any] | None],
    max_output: int = MAX_OUTPUT,
) -> tuple[Exchange, dict[str, Any] | None]:
    """Send ``payload`` to a worker (``worker``: interpreter and script) and wait for it.

    ``read(path, log)`` reads the response file (raising on one off the protocol);
    what it returns is handed back with how the request ended. A worker answering
    ``"reusable": true`` is kept for the next request with the same key. A worker
    writing more than ``max_output`` bytes of output is killed (``flooded``).
    """
    key = (name, *worker, json.dumps(sorted(i for i in env.items() if i[0] not in _VOLATILE)))
    session, resp, start = _SESSIONS.pop(key, None), None, 0
    if session is not None and not session.alive():
        session.close()
        session = None
    if session is not None:
        try:
            resp, start = _send(session, payload)
        except OSError:  # it exited since its last answer
            session.close(kill=True)
            session = None
    if session is None or resp is None:
        session, resp = _fresh(name, worker, env, payload)
    ended = _wait(session, resp, timeout, start, max_output)
    try:
        response = None if ended.flooded else read(resp, ended.log)
    except BaseException:
        session.close(kill=True)
        raise
    if ended.timed_out or ended.flooded:
        session.close(kill=True)
    elif ended.code is None and isinstance(response, dict) and response.get("reusable") is True:
        _keep(key, session)
    else:
        session.close()
        ended.code = session.proc.returncode
    return ended, response


def _keep(key: tuple[str, ...], session: _Session) -> None:
    _SESSIONS[key] = session
    while len(_SESSIONS) > MAX_SESSIONS:
        _, oldest = _SESSIONS.popitem(last=False)
        oldest.close()


def close_all() -> None:
    """Close every kept worker (stdin closed: it exits; killed if it does not in 10 s)."""
    while _SESSIONS:
        _, session = _SESSIONS.popitem()
        session.close()


atexit.register(close_all)
