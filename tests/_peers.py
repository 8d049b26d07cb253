"""The reference producers' own checkpoints of the real model, built once per machine.

llm-compressor (``make engines``: ``.venv-engines/llmcompressor``, pinned by
``.ci/engines/llmcompressor.txt``) runs in a child process of its own interpreter
(``tests/_llmc_worker.py``; its pins conflict with ours). :func:`llmcompressor_checkpoint`
returns its ``oneshot`` checkpoint of a model directory (default: the real model,
``tests/_real_model.py``) for one of :data:`LLMC_RECIPES`, built on first use in a
temporary folder beside the cache entry and renamed into place under a lock (as
``tests/_real_model.py`` builds the model), keyed by llm-compressor's version and a hash
of the recipe, the worker, the calibration text and the source directory's name.

Calibration: :data:`CALIBRATION_SAMPLES` rows of :data:`CALIBRATION_SEQ_LEN` tokens of
fixed English text (:func:`calibration_text`: the Python reference's topics as the
interpreter ships them in ``pydoc_data``; any text may be passed instead).

Nothing here imports exportlm or transformers: tests and benchmarks
(``sys.path.insert(0, <repo>); from tests._peers import llmcompressor_checkpoint``) use it
alike. ``python tests/_peers.py [RECIPE ...]`` builds them and prints their directories.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests._real_model import built_once, cache_root, real_model_dir

#: The recipes :func:`llmcompressor_checkpoint` builds (``tests/_llmc_worker.py`` RECIPES):
#: FP8 static, FP8 + an FP8 KV cache, INT8 W8A8 after SmoothQuant, NVFP4, FP8 dynamic.
LLMC_RECIPES = ("fp8", "fp8_kv", "w8a8_sq", "nvfp4", "fp8_dynamic")
#: The environment variable naming llm-compressor's interpreter (the Makefile's ENGINE_ENV).
LLMC_ENV = "EXPORTLM_ENGINE_LLMCOMPRESSOR"
CALIBRATION_SAMPLES = 16
CALIBRATION_SEQ_LEN = 256
#: A build's limit: about 2 min each on 2 free cores (NVFP4's compression is the slowest).
BUILD_TIMEOUT_S = 1200
_REPO = Path(__file__).resolve().parent.parent
_WORKER = Path(__file__).resolve().parent / "_llmc_worker.py"


def llmcompressor_python() -> Path:
    """llm-compressor's interpreter: ``$EXPORTLM_ENGINE_LLMCOMPRESSOR``, else ``make engines``'."""
    explicit = os.environ.get(LLMC_ENV)
    if explicit:
        return Path(explicit)
    return _REPO / ".venv-engines" / "llmcompressor" / "bin" / "python"


def llmcompressor_missing_reason() -> str | None:
    """Why no llm-compressor checkpoint can be built here (None when one can)."""
    python = llmcompressor_python()
    if not python.is_file():
        return (
            f"no llm-compressor interpreter at {python}: run `make engines` "
            f"(or set {LLMC_ENV} to a python with llmcompressor installed)"
        )
    return None


def calibration_text() -> str:
    """Fixed English prose: the Python reference's topics, in sorted order (``pydoc_data``)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def llmcompressor_version(python: Path | None = None) -> str:
    """The installed llmcompressor's version in ``python`` (without importing it)."""
    done = subprocess.run(
        [str(python or llmcompressor_python()), "-c",
         "import importlib.metadata as m; print(m.version('llmcompressor'))"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout.strip()


def llmcompressor_checkpoint(
    recipe: str,
    source: Path | None = None,
    *,
    text: str | None = None,
    samples: int = CALIBRATION_SAMPLES,
    seq_len: int = CALIBRATION_SEQ_LEN,
    python: Path | None = None,
) -> Path:
    """llm-compressor's compressed checkpoint of ``source`` for ``recipe``, cached per machine.

    Raises:
        ValueError: ``recipe`` is not one of :data:`LLMC_RECIPES`.
        RuntimeError: the interpreter is missing, or the build failed (its stderr's tail).
    """
    if recipe not in LLMC_RECIPES:
        raise ValueError(
            f"unknown llm-compressor recipe {recipe!r}; expected one of {LLMC_RECIPES}"
        )
    python = python or llmcompressor_python()
    if not python.is_file():
        raise RuntimeError(llmcompressor_missing_reason() or f"{python} is missing")
    source = Path(source) if source is not None else real_model_dir()
    text = calibration_text() if text is None else text
    key = hashlib.sha256()
    for part in (recipe, _WORKER.read_text(), text, str(samples), str(seq_len), source.name):
        key.update(part.encode() + b"\0")
    version = llmcompressor_version(python)
    target = cache_root() / f"llmc-{version}-{recipe}-{source.name}-{key.hexdigest()[:12]}"
    return built_once(
        target, lambda staging: _build(python, source, recipe, text, samples, seq_len, staging)
    )


def _build(
    python: Path, source: Path, recipe: str, text: str, samples: int, seq_len: int, out: Path
) -> None:
    text_file = out / "calibration.txt"
    text_file.write_text(text, encoding="utf-8")
    argv = [str(python), str(_WORKER), str(source), recipe, str(text_file)]
    argv += [str(samples), str(seq_len), str(out / "model")]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": ""}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"llm-compressor's {recipe} build failed:\n{done.stderr[-4000:]}")
    text_file.unlink()
    for item in (out / "model").iterdir():  # the checkpoint's files at the top level
        item.rename(out / item.name)
    (out / "model").rmdir()


if __name__ == "__main__":
    for name in sys.argv[1:] or LLMC_RECIPES:
        print(llmcompressor_checkpoint(name))


# transformers' logits of a checkpoint, computed by another interpreter (an engine venv):
# bf16 and eager attention, as the fake-quantized model computes.
_TRANSFORMERS_LOGITS = """
import json, sys, torch
from transformers import AutoModelForCausalLM
directory, ids, out = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(
    directory, dtype=torch.bfloat16, attn_implementation="eager"
).eval()
with torch.no_grad():
    logits = model(torch.tensor(json.loads(open(ids).read())), use_cache=False).logits
torch.save(logits.float(), out)
"""


def transformers_logits(python: Path, directory: Path, ids: Any, work: Path) -> Any:
    """The float32 logits transformers in ``python`` computes for ``ids`` (a torch tensor) on
    the checkpoint ``directory`` (bf16, eager attention); ``work`` holds the exchange files."""
    import torch

    (work / "ids.json").write_text(json.dumps(ids.tolist()))
    (work / "logits.py").write_text(_TRANSFORMERS_LOGITS)
    argv = [str(python), str(work / "logits.py"), str(directory), str(work / "ids.json")]
    subprocess.run([*argv, str(work / "l.pt")], check=True, capture_output=True, timeout=600)
    return torch.load(work / "l.pt", weights_only=True)
