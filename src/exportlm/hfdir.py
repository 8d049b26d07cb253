"""Reading a Hugging Face model directory that exportlm did not write.

The one place that reads ``config.json`` (and other small JSON files) of a
directory from elsewhere and decides whether it would need code of its own to
load. Everything that hands such a directory to transformers (the CLI's
``--model DIR``, the ``hf_checkpoint`` runtime, ``exportlm inspect``) calls
:func:`read_json_object` / :func:`read_config` and :func:`refuse_custom_code`
first, so a malformed file is an exportlm error naming it and a directory with
``auto_map`` or ``*.py`` files is refused before transformers imports anything.

Torch-free and transformers-free.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from exportlm.errors import (
    CustomCodeRefusedError,
    ExportLMError,
    InvalidConfigError,
    MalformedCheckpointError,
    NotRegularFileError,
)
from exportlm.safeio import ensure_no_special_files, read_regular_bytes

__all__ = [
    "CONFIG_NAME",
    "MAX_JSON_BYTES",
    "custom_code_reasons",
    "read_config",
    "read_json_object",
    "refuse_custom_code",
    "TOKENIZER_FILES",
    "check_loading_info",
    "shard_name_problem",
    "tokenizer_files",
    "transformers_errors",
    "vet_model_directory",
]

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
#: The largest JSON file read whole (an index of a 700B model is a few MB).
MAX_JSON_BYTES = 64 * 1024 * 1024
#: Small JSON files beside config.json whose ``auto_map`` would also load code.
_CODE_CONFIGS = ("tokenizer_config.json", "preprocessor_config.json", "processor_config.json")
#: The files of a model directory that its tokenizer and chat template are read from
#: (what ``save_pretrained`` of transformers' tokenizers writes), copied into a checkpoint.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)
#: The weight files transformers reads from a directory: the single file first, else the index.
SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
#: The folder transformers saves a tokenizer's further named chat templates into.
_TEMPLATES_FOLDER = "additional_chat_templates"


def read_json_object(path: str | os.PathLike[str], *, what: str) -> dict[str, Any]:
    """The JSON object in the regular file ``path``.

    Raises :class:`MalformedCheckpointError` naming the file for anything that is
    not a JSON object of at most :data:`MAX_JSON_BYTES` (binary garbage, a list,
    nesting too deep to parse), :class:`NotRegularFileError` for a FIFO / device /
    directory and :class:`FileNotFoundError` when it is absent.
    """
    try:
        data = read_regular_bytes(path, what=what, max_bytes=MAX_JSON_BYTES)
    except ValueError as err:
        if isinstance(err, NotRegularFileError):
            raise
        raise MalformedCheckpointError(str(err), path=path) from err
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise MalformedCheckpointError(
            f"{what} {path} is not UTF-8 text ({err.reason} at byte {err.start}); "
            "expected a JSON object",
            path=path,
        ) from err
    except json.JSONDecodeError as err:
        raise MalformedCheckpointError(
            f"{what} {path} is not valid JSON (line {err.lineno}, column {err.colno}: "
            f"{err.msg}); expected a JSON object",
            path=path,
        ) from err
    except RecursionError as err:
        raise MalformedCheckpointError(
            f"{what} {path} is nested too deeply to parse; expected a JSON object", path=path
        ) from err
    if not isinstance(value, dict):
        raise MalformedCheckpointError(
            f"{what} {path} holds a JSON {type(value).__name__}, expected a JSON object",
            path=path,
        )
    return value


def read_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """``config.json`` of ``directory`` as a dict (see :func:`read_json_object`)."""
    return read_json_object(Path(directory) / CONFIG_NAME, what="model config")


def custom_code_reasons(
    directory: str | os.PathLike[str], config: dict[str, Any] | None = None
) -> list[str]:
    """What in ``directory`` would make transformers run the directory's own code.

    ``auto_map`` in ``config.json`` or in a tokenizer / processor config, and any
    ``*.py`` file at the top of the directory. Empty when nothing would run.
    """
    root = Path(directory)
    reasons: list[str] = []
    configs: list[tuple[str, dict[str, Any] | None]] = [(CONFIG_NAME, config)]
    configs += [(name, None) for name in _CODE_CONFIGS]
    for name, data in configs:
        if data is None:
            try:
                data = read_json_object(root / name, what=name)
            except FileNotFoundError:
                continue
        auto_map = data.get("auto_map")
        if auto_map:
            targets = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
            shown = ", ".join(sorted(str(t) for t in targets))
            reasons.append(f"{name} has auto_map -> {shown}")
    try:
        python_files = sorted(p.name for p in root.iterdir() if p.suffix == ".py")
    except OSError:
        python_files = []
    if python_files:
        reasons.append(f"Python files {', '.join(python_files)}")
    return reasons


def refuse_custom_code(
    directory: str | os.PathLike[str], config: dict[str, Any] | None = None
) -> None:
    """Raise :class:`CustomCodeRefusedError` if loading ``directory`` would run its own code."""
    reasons = custom_code_reasons(directory, config)
    if reasons:
        raise CustomCodeRefusedError(directory, reasons)


def vet_model_directory(
    directory: str | os.PathLike[str], *, what: str = "model directory"
) -> dict[str, Any]:
    """``config.json`` of ``directory``, once the directory is safe to hand to transformers.

    The checks every caller of ``from_pretrained`` on a directory from elsewhere
    needs, in order: ``directory`` is a directory and none of its files is a FIFO,
    device or socket (:class:`NotRegularFileError`: transformers would block
    opening it); ``config.json`` is a JSON object (:class:`MalformedCheckpointError`,
    :class:`FileNotFoundError`); nothing in it would run the directory's own
    code (:class:`CustomCodeRefusedError`); and every shard a ``*.index.json``
    names is a file name inside the directory (:class:`MalformedCheckpointError`;
    a name like ``../../dev/zero`` would be opened by the loader). Nothing of the
    directory is imported.
    """
    ensure_no_special_files(directory, what=what)
    config = read_config(directory)
    refuse_custom_code(directory, config)
    _check_shard_names(Path(directory))
    return config


def shard_name_problem(directory: str | os.PathLike[str], name: str) -> str | None:
    """Why shard ``name`` (from a weight index) is not a file of ``directory``; ``None``: it is.

    The one confinement rule for shard names, used by :func:`vet_model_directory`
    and the ``hf_checkpoint`` loader: a plain file name next to the index (not
    empty, no NUL, not ``.`` / ``..``, no path separator, so no absolute path and
    no ``..`` component), and, where it is a symbolic link, one that resolves
    inside ``directory``.
    """
    if not name or "\x00" in name or name in (".", ".."):
        return f"{name!r} is not a file name"
    parts = name.replace("\\", "/").split("/")
    if name[:1] in ("/", "\\") or (name[:1].isalpha() and name[1:2] == ":"):
        return f"{name!r} is an absolute path"
    if ".." in parts:
        return f"{name!r} climbs out of the directory ('..')"
    if len(parts) > 1:
        return f"{name!r} is a path, not a plain file name"
    root = os.path.realpath(directory)
    target = os.path.realpath(Path(directory) / name)
    if os.path.commonpath([root, target]) != root:
        return f"{name!r} is a symbolic link to {target}, outside {directory}"
    return None


def _check_shard_names(root: Path) -> None:
    """Every shard a weight index names is a file of ``root`` (:func:`shard_name_problem`),
    and every shard of the index transformers reads (``model.safetensors.index.json``
    where there is no ``model.safetensors``, which it would read instead) is there."""
    for index in sorted(root.glob("*.index.json")):
        weight_map = read_json_object(index, what="weight index").get("weight_map", {})
        names = weight_map.values() if isinstance(weight_map, dict) else [weight_map]
        read = index.name == SAFETENSORS_INDEX and not os.path.lexists(root / SAFETENSORS_SINGLE)
        for name in sorted({str(n) for n in names}):
            why = shard_name_problem(root, name)
            if why is not None:
                raise MalformedCheckpointError(
                    f"weight index {index} names shard {name!r}, which is not a file name "
                    f"inside the checkpoint directory ({why}); expected names such as "
                    "model-00001-of-00002.safetensors",
                    path=index,
                    field="weight_map",
                )
            if read and not os.path.lexists(root / name):
                raise MalformedCheckpointError(
                    f"weight index {index} names shard {name!r}, which is not in the "
                    "directory; expected every shard the index names (a partial download "
                    "or copy: fetch the missing shard)",
                    path=index,
                    field="weight_map",
                )


def tokenizer_files(
    directory: str | os.PathLike[str], names: Sequence[str] = TOKENIZER_FILES
) -> dict[str, bytes]:
    """The tokenizer files of ``directory`` (``names``, ``additional_chat_templates/*.jinja``).

    ``{relative name: bytes}``, empty when there is none. Each is read as
    :func:`read_json_object` reads (a regular file, at most :data:`MAX_JSON_BYTES`), and a
    symbolic link is followed only where it resolves inside ``directory`` (the rule of
    :func:`shard_name_problem`). A directory whose tokenizer config would load code of
    its own (``auto_map``, ``*.py``) is refused, as for loading it.

    Raises:
        CustomCodeRefusedError: ``auto_map`` or ``*.py`` files in ``directory``.
        MalformedCheckpointError: a link out of the directory, or a file over the limit.
        NotRegularFileError: a FIFO, device or socket under a tokenizer file's name.
    """
    root = Path(directory)
    refuse_custom_code(root)
    names = [name for name in names if os.path.lexists(root / name)]
    templates = root / _TEMPLATES_FOLDER
    if templates.is_dir() and _outside(root, _TEMPLATES_FOLDER) is None:
        names += [f"{_TEMPLATES_FOLDER}/{p.name}" for p in sorted(templates.glob("*.jinja"))]
    return {name: _tokenizer_file(root, name) for name in names}


def _outside(root: Path, name: str) -> str | None:
    folder, _, base = name.rpartition("/")
    return shard_name_problem(root / folder if folder else root, base)


def _tokenizer_file(root: Path, name: str) -> bytes:
    path = root / name
    problem = _outside(root, name)
    if problem is None and name.startswith(_TEMPLATES_FOLDER):
        problem = _outside(root, _TEMPLATES_FOLDER)  # the folder, too, stays inside
    if problem is not None:
        raise MalformedCheckpointError(
            f"tokenizer file {path}: {problem}; expected the tokenizer's files inside the "
            "model directory (copy them in, e.g. `cp -L`, to export them with the model)",
            path=path,
        )
    try:
        return read_regular_bytes(path, what="tokenizer file", max_bytes=MAX_JSON_BYTES)
    except ValueError as err:
        if isinstance(err, NotRegularFileError):
            raise
        raise MalformedCheckpointError(str(err), path=path) from err


@contextlib.contextmanager
def transformers_errors(where: str, action: str) -> Iterator[None]:
    """A failure of transformers while it ``action``s a vetted directory: one
    :class:`~exportlm.errors.InvalidConfigError` beginning with ``where``.

    transformers raises what its parsers and validators raise for a directory whose
    files are wrong: ``OSError``, ``ValueError``, ``KeyError``, safetensors'
    ``SafetensorError``, huggingface_hub's ``StrictDataclass*Error`` (``hidden_size``
    not a multiple of the heads), ``RuntimeError`` (weights of other shapes, a garbage
    ``pytorch_model.bin``), ``AttributeError`` / ``TypeError`` (a field of another
    type). Its calls here have fixed arguments on a vetted local directory, so a failure
    inside them is the directory's (or the installed transformers'); ``MemoryError``
    and exportlm's own errors pass through unchanged.
    """
    try:
        yield
    except (MemoryError, ExportLMError):
        raise
    except Exception as err:
        detail = " ".join(str(err).split()) or "no message"
        raise InvalidConfigError(
            f"{where}: transformers cannot {action} from this directory "
            f"({type(err).__name__}: {detail})"
        ) from err


def check_loading_info(info: Mapping[str, Any], where: str, model: str) -> None:
    """Refuse what ``from_pretrained(..., output_loading_info=True)`` initialised at random.

    A weight no shard holds (``missing_keys``) is initialised at random by transformers,
    with a log line: the model computes garbage. A stored tensor ``model`` (its class
    name) has no place for (``unexpected_keys``: DeepSeek-V3's multi-token-prediction
    layers, for one) is left out, and said.

    Raises:
        InvalidConfigError: a missing weight, named.
    """
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise InvalidConfigError(
            f"{where}: no shard holds {len(missing)} weight(s) the config needs "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); transformers "
            "would initialise them at random. Expected a complete checkpoint as "
            "save_pretrained writes it"
        )
    warn_left_out(sorted(info.get("unexpected_keys") or ()), where, model)


def warn_left_out(names: Sequence[str], where: str, model: str) -> None:
    """Say, once, that the stored tensors ``names`` are no weight of ``model`` and are left out."""
    if names:
        logger.warning(
            "%s: %d stored tensor(s) are no weight of %s and are left out (%s%s)",
            where, len(names), model, ", ".join(names[:3]), ", ..." if len(names) > 3 else "",
        )  # fmt: skip
