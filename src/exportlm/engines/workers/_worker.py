"""What every engine worker shares (standard library only; ``docs/engines.md``).

A worker runs as a script in the engine's own interpreter, where exportlm is not
installed: it imports this file as a sibling module (``import _worker``), never
``exportlm``. :func:`main` reads the request, imports the engine, writes a
``running`` response with the engine's version (so a crash still names it), runs
the worker's ``serve`` and writes the final response; with ``--more`` it then serves
further requests from stdin in the same process (the engine imported once). An exception of the engine
becomes ``refused`` with the stage it happened in and the engine's own message.
"""

from __future__ import annotations

import heapq
import importlib
import importlib.metadata
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

PROTOCOL = 1
_MAX_ERROR = 6000


class Context:
    """One run: the request, the stage it is in, the time each stage took and notes."""

    def __init__(self, request: dict[str, Any]) -> None:
        self.request = request
        self.stage_name = "load"
        self.seconds: dict[str, float] = {}
        self.notes: list[str] = []
        self.decode: dict[str, Any] | None = None

    def record_decode(
        self,
        logprobs: list[list[float]],
        top: list[list[list[tuple[int, float]]]] | None = None,
        cache_lengths: list[list[int]] | None = None,
    ) -> None:
        """Each generation step's own numbers, per row and step (``docs/engines.md``).

        ``logprobs[r][s]``: the chosen token's log-probability from that step's logits
        (step 0 is the prefill); ``top[r][s]``: the step's top-k ``(token, logprob)``,
        best first; ``cache_lengths[r][s]``: the row's KV-cache length after the step.
        """
        self.decode = {"logprobs": logprobs, "top": top, "cache_lengths": cache_lengths}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time a stage; an exception inside it is reported as refused at this stage."""
        self.stage_name = name
        start = time.perf_counter()
        yield
        self.seconds[name] = round(time.perf_counter() - start, 4)

    def options(self, known: Sequence[str]) -> dict[str, str]:
        """The request's engine options; one this worker does not know is refused."""
        given = dict(self.request.get("options") or {})
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(f"unknown engine options {unknown}; this worker takes {sorted(known)}")
        return {str(k): str(v) for k, v in given.items()}


def rows(request: dict[str, Any]) -> list[list[int]]:
    """Each prompt's real tokens (where its attention mask is 1)."""
    return [
        [int(t) for t, m in zip(ids, mask) if m]
        for ids, mask in zip(request["input_ids"], request["attention_mask"])
    ]


def position_ids(mask: Sequence[Sequence[int]]) -> list[list[int]]:
    """Positions counted from each row's first real token (0 on the padding)."""
    out = []
    for row in mask:
        seen, pos = 0, []
        for m in row:
            pos.append(max(seen - 1 + int(m), 0) if m else 0)
            seen += int(m)
        out.append(pos)
    return out


def log_softmax_at(logits: Sequence[float], index: int) -> float:
    """``log_softmax(logits)[index]`` in float64."""
    top = max(logits)
    total = math.fsum(math.exp(x - top) for x in logits)
    return float(logits[index] - top - math.log(total))


def step_logprobs(logits: Sequence[float], token: int, k: int = 2) -> tuple[float, list[Any]]:
    """One decode step's numbers from its logits: ``token``'s log-softmax and the top-k
    ``(token, logprob)`` pairs, best first (float64)."""
    top = max(logits)
    norm = top + math.log(math.fsum(math.exp(x - top) for x in logits))
    best = heapq.nlargest(k, range(len(logits)), key=lambda i: logits[i])
    return float(logits[token] - norm), [(i, float(logits[i] - norm)) for i in best]


class Steps:
    """Each decode step's numbers of a batch, gathered step by step (:func:`step_logprobs`)."""

    def __init__(self, rows: int) -> None:
        self.logprobs: list[list[float]] = [[] for _ in range(rows)]
        self.top: list[list[Any]] = [[] for _ in range(rows)]

    def add(self, row: int, logits: Sequence[float], token: int) -> None:
        """Row ``row``'s next step: its logits and the token chosen from them."""
        lp, top = step_logprobs(logits, token)
        self.logprobs[row].append(lp)
        self.top[row].append(top)

    def record(self, ctx: Context, cache_lengths: list[list[int]] | None = None) -> None:
        """Hand the steps to the response (:meth:`Context.record_decode`)."""
        ctx.record_decode(self.logprobs, self.top, cache_lengths)


def describe(err: BaseException) -> str:
    """The engine's error as text: each exception of the chain as ``Type: message``."""
    parts, seen = [], set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        parts.append(f"{type(current).__name__}: {current}".strip())
        current = current.__cause__ or current.__context__
    text = "\ncaused by: ".join(parts)
    return text if len(text) <= _MAX_ERROR else text[:_MAX_ERROR] + " ..."


def _version(distributions: Sequence[str], module: Any) -> str:
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return str(getattr(module, "__version__", "unknown"))


def _write(path: str | None, response: dict[str, Any]) -> None:
    text = json.dumps({"protocol": PROTOCOL, **response})
    if path is None:
        sys.stdout.write(text + "\n")
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        out.write(text)
    os.replace(tmp, path)


def _read(argv: Sequence[str]) -> tuple[dict[str, Any], str | None]:
    if len(argv) >= 2:
        with open(argv[1], encoding="utf-8") as f:
            request = json.load(f)
        return request, argv[2] if len(argv) >= 3 else None
    return json.load(sys.stdin), None


#: What an engine would load or run as code (exportlm refuses it before a worker starts;
#: workers check again: exportlm.engines.untrusted).
_CODE_NAME = re.compile(r"\.(py|pyc|pyo|pyd|pyx|so|dylib|dll)$|\.so(\.\d+)+$", re.IGNORECASE)
_LIBRARY_KEY = re.compile(r"librar|plugin|backend_path|lib_path|custom_op", re.IGNORECASE)


def artifact_folder(artifact: str) -> str:
    """The folder an engine reads for ``artifact`` (itself, or a file's folder)."""
    return artifact if os.path.isdir(artifact) else os.path.dirname(artifact)


def refuse_code(artifact: str) -> None:
    """Raise ``ValueError`` if the artifact's folder holds code, or a config naming a library."""
    folder = artifact_folder(artifact)
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in dirs + files:
            if name == "custom_generate" or _CODE_NAME.search(name):
                raise ValueError(f"{os.path.join(root, name)}: an artifact's code is never run")
    genai = os.path.join(folder, "genai_config.json")
    if os.path.isfile(genai):
        with open(genai, encoding="utf-8") as f:
            found = [k for k in _keys(json.load(f)) if _LIBRARY_KEY.search(k)]
        if found:
            raise ValueError(f"{genai} names a library to load ({found}); it is never loaded")


def _keys(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from _keys(item)
    elif isinstance(value, list):
        for item in value:
            yield from _keys(item)


def disable_custom_generate(mixin: Any) -> None:
    """Make transformers' ``GenerationMixin`` never load ``custom_generate/generate.py``.

    transformers 4.5x loads it from a local folder at ``from_pretrained`` even with
    ``trust_remote_code=False``; the OSError raised here is what it reads as "none".
    """

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OSError("custom_generate is disabled: exportlm never runs an artifact's code")

    mixin.load_custom_generate = refuse


Serve = Callable[[Context], tuple[list[list[int]], list[list[float]]]]

#: The argument after REQUEST.json RESPONSE.json that keeps the worker running: further
#: requests come as lines of JSON on stdin, ``{"request": PATH, "response": PATH}``.
MORE = "--more"


def _answer(
    request: dict[str, Any], out: str | None, base: dict[str, Any], serve: Serve, more: bool
) -> None:
    _write(out, {**base, "status": "running"})
    if request.get("action") == "probe":
        _write(out, {**base, "status": "ok", "reusable": more})
        return
    ctx = Context(request)
    try:
        tokens, logprobs = serve(ctx)
    except Exception as err:
        failed = {"status": "refused", "stage": ctx.stage_name, "error": describe(err)}
        _write(out, {**base, **failed, "reusable": more})
        return
    done = {"status": "ok", "tokens": tokens, "logprobs": logprobs, "reusable": more}
    if ctx.decode is not None:
        done["decode"] = ctx.decode
    _write(out, {**base, **done, "notes": ctx.notes, "seconds": ctx.seconds})


def _more() -> Iterator[tuple[dict[str, Any], str]]:
    """The requests after the first, one line of stdin each, until stdin closes."""
    for line in sys.stdin:
        if not line.strip():
            continue
        paths = json.loads(line)
        with open(paths["request"], encoding="utf-8") as f:
            yield json.load(f), str(paths["response"])


def main(
    engine: str,
    module: str,
    distributions: Sequence[str],
    serve: Serve,
    reset: Callable[[], None] | None = None,
) -> int:
    """Run the request through ``serve``; always exits 0 once a response is written.

    Given :data:`MORE` after the two paths, the worker then serves each request read
    from stdin in turn (the engine imported once), calling ``reset`` between two (what
    the engine keeps between runs that the next one must not see), and exits when stdin
    closes. Every response says ``"reusable": true`` then; without it, false.
    """
    request, out = _read(sys.argv)
    more = len(sys.argv) >= 4 and sys.argv[3] == MORE
    base: dict[str, Any] = {"engine": engine}
    try:
        imported = importlib.import_module(module)
    except Exception as err:
        _write(out, {**base, "status": "unavailable", "error": describe(err)})
        return 0
    base["engine_version"] = _version(distributions, imported)
    _answer(request, out, base, serve, more)
    if not more:
        return 0
    for request, path in _more():
        if reset is not None:
            reset()
        _answer(request, path, base, serve, more)
    return 0
