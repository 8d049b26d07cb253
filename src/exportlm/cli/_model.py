"""The ``--model`` argument: a toy family, a model spec file or a local Hugging Face directory.

Nothing is ever downloaded, and no code of a model directory ever runs: a
directory whose ``config.json`` (or tokenizer config) has an ``auto_map``, or
that holds ``*.py`` files, is refused (:class:`~exportlm.errors.CustomCodeRefusedError`)
before transformers sees it, and every transformers call passes
``trust_remote_code=False``, so transformers never prompts on standard input. A
FIFO, device or socket where a file is read (the spec file, any file of the
directory) is a usage error before anything is opened. An argument that is none
of the three is a :class:`~exportlm.cli._errors.UsageError` that says which of
them it looked like: a Hub id (``org/name``), a path that does not exist, or an
unknown family.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from exportlm.cli._errors import UsageError
from exportlm.errors import (
    ExportLMError,
    InvalidConfigError,
    MalformedCheckpointError,
    NotRegularFileError,
)
from exportlm.hfdir import CONFIG_NAME, vet_model_directory
from exportlm.safeio import ensure_regular_file, read_regular_text

__all__ = ["ModelSource", "load_model_spec", "resolve_model"]

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
#: A model spec is a few hundred bytes; anything much larger is not one.
_MAX_SPEC_BYTES = 1024 * 1024
_KINDS = (
    "a toy family (see `exportlm list`), a model spec FILE.json "
    "or a local Hugging Face model directory"
)


@dataclass(frozen=True)
class ModelSource:
    """What a ``--model`` argument names.

    Attributes:
        kind: ``"family"`` (a registered toy family), ``"spec"`` (a
            :class:`~exportlm.models.ModelSpec` JSON file) or ``"directory"``
            (a local Hugging Face model directory with ``config.json``).
        name: the family name, or the path as given.
        path: the file or directory, for ``spec`` and ``directory``.
    """

    kind: Literal["family", "spec", "directory"]
    name: str
    path: Path | None = None

    def build(self, seed: int = 0) -> Any:
        """The model: seeded for a family or spec, loaded from local files for a directory."""
        if self.kind == "family":
            from exportlm.models import build_model

            return build_model(self.name, seed=seed)
        path = self.path if self.path is not None else Path(self.name)
        if self.kind == "spec":
            return _model_from_json(path, seed)
        return _model_from_directory(path)


def resolve_model(argument: str) -> ModelSource:
    """The :class:`ModelSource` an argument names, checked without building anything.

    A directory is vetted here already (:func:`_vet_directory`), so a refusal
    comes before any other work of the command.

    Raises:
        UsageError: a directory without ``config.json``, a file that is not
            ``.json``, a Hub id, a missing path or an unknown family, each with
            what to do instead; a FIFO, device or socket as the spec file or in
            the directory.
        InvalidConfigError: a directory whose ``config.json`` is not a JSON object.
        CustomCodeRefusedError: a directory that would run code of its own.
    """
    path = Path(argument).expanduser()
    if path.suffix.lower() == ".json" and not path.is_dir():
        if path.exists():  # a missing file is reported when it is read
            _checked(lambda: ensure_regular_file(path, what="model spec file"), argument)
        return ModelSource("spec", argument, path)
    if path.is_dir() and (path / CONFIG_NAME).exists():
        _vet_directory(path, argument)
        return ModelSource("directory", argument, path)
    from exportlm.models import model_names

    families = model_names()
    name = argument.removeprefix("hf:")
    if name in families:  # a family name wins over a directory that is no model
        return ModelSource("family", name)
    if path.is_dir():
        raise UsageError(
            f"--model {argument}: the directory has no config.json; expected a local "
            "Hugging Face model directory (as written by save_pretrained)"
        )
    if path.exists():
        raise UsageError(f"--model {argument}: is a file that is not .json; expected {_KINDS}")
    if _HUB_ID.fullmatch(argument) and not Path(argument.split("/")[0]).exists():
        raise UsageError(
            f"--model {argument}: exportlm never downloads from the Hugging Face Hub; "
            f"download it (e.g. `huggingface-cli download {argument} --local-dir DIR`) "
            "and pass DIR"
        )
    if "/" in argument or "\\" in argument or argument.startswith((".", "~")) or path.suffix:
        raise UsageError(f"--model {argument}: no such file or directory: {argument}")
    raise UsageError(
        f"--model {argument}: unknown model family {name!r}; available: {', '.join(families)}; "
        "or pass a model spec FILE.json or a local Hugging Face model directory"
    )


def load_model_spec(spec: str, seed: int = 0) -> Any:
    """Build the model named by a command-line ``--model`` argument.

    ``hf:FAMILY`` and registered family names build seeded toy models (no
    download); a path ending in ``.json`` holds a model structure
    (:class:`exportlm.models.ModelSpec`, as the conformance suite's
    ``roundtrip_generated`` writes it) built by
    :func:`exportlm.models.build_from_spec`; an existing directory loads a local
    Hugging Face checkpoint with ``local_files_only=True``.

    Raises:
        UsageError: the argument names nothing (see :func:`resolve_model`).
        InvalidConfigError: an unreadable or invalid ``.json`` file or model
            directory, naming the file and what is wrong.
    """
    return resolve_model(spec).build(seed)


def _checked(check: Any, argument: str) -> Any:
    """``check()``, with a special file (FIFO, device, socket) as a usage error naming ``--model``."""
    try:
        return check()
    except NotRegularFileError as err:
        raise UsageError(f"--model {argument}: {err}") from err


def _vet_directory(path: Path, argument: str) -> None:
    """Refuse a directory that transformers could not load without blocking or running its code.

    Raises:
        UsageError: a FIFO, device or socket in the directory.
        InvalidConfigError: ``config.json`` is not a JSON object, or names shards
            outside the directory, or the directory holds a quantized checkpoint (its
            fields are checked when the model is built, with transformers imported).
        CustomCodeRefusedError: ``auto_map`` or ``*.py`` (the message says what would run).
    """
    from exportlm.checkpoint import refuse_quantized_source

    try:
        config = _checked(lambda: vet_model_directory(path), argument)
    except (MalformedCheckpointError, FileNotFoundError) as err:
        raise InvalidConfigError(f"--model {argument}: {err}") from err
    refuse_quantized_source(path, config, f"--model {argument}")


def _model_from_json(path: Path, seed: int) -> Any:
    """The model of the :class:`~exportlm.models.ModelSpec` JSON file at ``path``."""
    from exportlm.models import build_from_spec

    try:
        text = read_regular_text(path, what="model spec file", max_bytes=_MAX_SPEC_BYTES)
    except NotRegularFileError as err:
        raise UsageError(f"--model {path}: {err}") from err
    except (OSError, ValueError) as err:  # missing, unreadable, not UTF-8, too large
        raise InvalidConfigError(f"--model {path}: cannot read the model spec file: {err}") from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidConfigError(
            f"--model {path}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); "
            "expected a model spec object as written by ModelSpec.to_json()"
        ) from err
    except RecursionError as err:
        raise InvalidConfigError(
            f"--model {path}: the JSON is nested too deeply to parse; expected a model spec "
            "object as written by ModelSpec.to_json()"
        ) from err
    try:
        return build_from_spec(data, seed=seed)
    except ExportLMError as err:
        raise InvalidConfigError(f"--model {path}: {err}") from err


def _model_from_directory(path: Path) -> Any:
    """The causal LM saved in ``path``, from local files only, never running the directory's code.

    Vetted again (a :class:`ModelSource` can be made without :func:`resolve_model`).
    """
    from exportlm.export.hf_checkpoint.source_model import load_source_model

    _vet_directory(path, str(path))
    with _without_transformers_bars():
        return load_source_model(path, f"--model {path}")


@contextlib.contextmanager
def _without_transformers_bars() -> Iterator[None]:
    """No "Loading weights" bar from transformers: the command's own spinner covers loading,
    and two bars on one line garble each other."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
