"""An artifact is data: what its folder may not hold before an engine's worker starts.

:func:`vet_artifact` reads the artifact's folder (a checkpoint directory, or the
folder of an ``.onnx`` file: onnxruntime-genai and Optimum load the whole folder)
without opening anything but small JSON configs, and refuses, with
:class:`~exportlm.errors.EngineArtifactRefusedError`, anything an engine would load
or run as code:

- a file or link named like a library or Python (``*.so``, ``*.so.N``, ``*.dylib``,
  ``*.dll``, ``*.py``, ``*.pyc``, ...) or a ``custom_generate`` entry, at any depth
  (transformers 4.5x imports ``custom_generate/generate.py`` of a local folder even
  with ``trust_remote_code=False``);
- an ``auto_map`` in ``config.json`` or a tokenizer / processor config
  (:func:`exportlm.hfdir.custom_code_reasons`);
- in ``genai_config.json``: a key that names a library (``custom_ops_library``, any
  ``*library*`` / ``*plugin*`` / ``backend_path`` key), a ``session_options`` key
  outside :data:`GENAI_SESSION_KEYS`, a path-like key inside ``session_options``
  (provider or config entries that load or write files), and a ``filename`` that is
  not a plain file name inside the folder.

Torch-free; the engines room's only reader of artifact configs besides ``artifact``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from exportlm.errors import EngineArtifactRefusedError
from exportlm.hfdir import custom_code_reasons, read_json_object, shard_name_problem

__all__ = ["CODE_DIRS", "GENAI_SESSION_KEYS", "MAX_ENTRIES", "vet_artifact"]

#: Names an engine would import or load as code (a shared library keeps ``.so.1.2``).
_CODE_NAME = re.compile(r"\.(py|pyc|pyo|pyd|pyx|so|dylib|dll)$|\.so(\.\d+)+$", re.IGNORECASE)
#: Folders an engine runs code from: transformers' ``custom_generate/generate.py``.
CODE_DIRS = frozenset({"custom_generate"})
#: The most entries of an artifact folder checked; a larger folder is refused unchecked.
MAX_ENTRIES = 10_000
GENAI_CONFIG = "genai_config.json"
#: onnxruntime-genai ``session_options`` keys that load and write nothing.
GENAI_SESSION_KEYS = frozenset(
    {
        "log_id",
        "log_severity_level",
        "intra_op_num_threads",
        "inter_op_num_threads",
        "enable_cpu_mem_arena",
        "enable_mem_pattern",
        "disable_cpu_ep_fallback",
        "disable_quant_qdq",
        "enable_quant_qdq_cleanup",
        "graph_optimization_level",
        "use_env_allocators",
        "provider_options",
        "providers",
        "config_entries",
    }
)
#: A key naming a library to load, anywhere in ``genai_config.json``.
_LIBRARY_KEY = re.compile(r"librar|plugin|backend_path|lib_path|custom_op", re.IGNORECASE)
#: A key naming a file or folder, inside ``session_options`` (provider and config entries).
_PATH_KEY = re.compile(r"path|file|dir|librar|plugin|backend|custom_op", re.IGNORECASE)


def _entries(folder: Path) -> Iterator[Path]:
    """Every entry under ``folder`` (links listed, never followed); at most MAX_ENTRIES."""
    seen = 0
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in sorted(dirs) + sorted(files):
            seen += 1
            if seen > MAX_ENTRIES:
                raise EngineArtifactRefusedError(
                    folder,
                    [f"more than {MAX_ENTRIES} entries to check (not an artifact folder)"],
                    "",
                )
            yield Path(root, name)


def code_entries(folder: Path) -> list[str]:
    """Entries of ``folder`` an engine would load or run as code, as relative paths."""
    found = []
    for entry in _entries(folder):
        if entry.name in CODE_DIRS or _CODE_NAME.search(entry.name):
            found.append(entry.relative_to(folder).as_posix())
    return found


def _walk(value: Any, where: str) -> Iterator[tuple[str, str, Any]]:
    """(dotted parent path, key, value) of every key in a JSON tree."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield where, str(key), item
            yield from _walk(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _walk(item, f"{where}[{i}]")


def genai_config_reasons(folder: Path) -> list[str]:
    """What in ``folder``'s ``genai_config.json`` would load a library or leave the folder."""
    try:
        config = read_json_object(folder / GENAI_CONFIG, what=GENAI_CONFIG)
    except FileNotFoundError:
        return []
    reasons = []
    for where, key, value in _walk(config, ""):
        named = f"{GENAI_CONFIG} {where}.{key}" if where else f"{GENAI_CONFIG} {key}"
        in_session = "session_options" in where
        if _LIBRARY_KEY.search(key):
            reasons.append(f"{named} names a library to load ({value!r})")
        elif where.endswith("session_options") and key not in GENAI_SESSION_KEYS:
            reasons.append(f"{named} is not a session option known to load nothing")
        elif in_session and _PATH_KEY.search(key):
            reasons.append(f"{named} names a file or folder ({value!r})")
        elif key.endswith("filename") and isinstance(value, str):
            why = shard_name_problem(folder, value)
            if why is not None:
                reasons.append(f"{named} is not a file of the artifact's folder: {why}")
    return reasons


def vet_artifact(artifact: Path, engine: str) -> Path:
    """The folder ``engine`` would read for ``artifact``, once it holds nothing that runs.

    Raises :class:`~exportlm.errors.EngineArtifactRefusedError` naming every reason,
    and what :func:`exportlm.hfdir.read_json_object` raises for a malformed config.
    """
    folder = artifact if artifact.is_dir() else artifact.parent
    try:
        reasons = [f"{name} (code an engine would load)" for name in code_entries(folder)]
    except EngineArtifactRefusedError as err:
        raise EngineArtifactRefusedError(folder, err.reasons, engine) from None
    reasons += [r for r in custom_code_reasons(folder) if "auto_map" in r]  # *.py: above
    reasons += genai_config_reasons(folder)
    if reasons:
        raise EngineArtifactRefusedError(folder, sorted(set(reasons)), engine)
    return folder
