"""The tokenizer files a checkpoint carries beside its weights (``tokenizer=``).

A checkpoint is servable only with its tokenizer and chat template: vLLM and transformers
read ``tokenizer.json`` / ``tokenizer_config.json`` / ``chat_template.jinja`` from the
same directory. The ``hf_checkpoint`` target and the streaming export take them from a
tokenizer object (its ``save_pretrained``) or a directory (its tokenizer files, read by
:func:`exportlm.hfdir.tokenizer_files`: regular files, no link out of the directory, no
directory that would run code of its own). They are read before the export does any
work, so a refused tokenizer costs nothing, and written into the staged checkpoint, so
the manifest lists each with its digest like every file. A JSON file that is no JSON
object, or a chat template that does not compile (:mod:`exportlm.tokenizer_checks`), is
refused: the checkpoint's tokenizer would not load, or every chat request would fail.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from exportlm.checkpoint import HF_QUANT_CONFIG_NAME
from exportlm.errors import InvalidConfigError, InvalidOptionError
from exportlm.hfdir import tokenizer_files
from exportlm.tokenizer_checks import chat_template_problems, json_problems

__all__ = ["describe_tokenizer", "refuse_broken_tokenizer", "tokenizer_payload"]

#: What the export writes itself: a tokenizer's file never replaces one of these.
_CHECKPOINT_OWN = ("config.json", "generation_config.json", HF_QUANT_CONFIG_NAME)


def tokenizer_payload(tokenizer: Any, scratch: Path | None = None) -> dict[str, bytes]:
    """``{relative name: bytes}`` of ``tokenizer``'s files (empty for ``None``).

    Args:
        tokenizer: ``None``, a directory (``str`` / path: its tokenizer files), or an
            object with ``save_pretrained(directory)`` (a transformers tokenizer or
            processor), saved into a temporary folder under ``scratch``.
        scratch: where that folder is made (default: the system's temporary folder).

    Raises:
        InvalidOptionError: ``tokenizer`` is none of these, or names no directory.
        InvalidConfigError: a JSON file among them is no JSON object, or a chat template
            does not compile.
    """
    if tokenizer is None:
        return {}
    if isinstance(tokenizer, (str, os.PathLike)):
        path = Path(tokenizer)
        if not path.is_dir():
            raise InvalidOptionError(
                f"tokenizer={os.fspath(tokenizer)!r} is not a directory; expected a folder "
                "holding the tokenizer's files (as save_pretrained writes them) or a "
                "tokenizer object"
            )
        files = tokenizer_files(path)
    else:
        files = _saved(tokenizer, scratch)
    files = {name: data for name, data in files.items() if name not in _CHECKPOINT_OWN}
    refuse_broken_tokenizer(files, describe_tokenizer(tokenizer))
    return files


def refuse_broken_tokenizer(files: Mapping[str, bytes], source: Any) -> None:
    """Refuse tokenizer ``files`` (from ``source``) that would not load, or whose chat
    template does not compile.

    Raises:
        InvalidConfigError: naming the file and what is wrong with it.
    """
    for name, problem in json_problems(files)[:1]:
        raise InvalidConfigError(
            f"the tokenizer file {name} of {os.fspath(source)} {problem}: the checkpoint's "
            "tokenizer would not load (transformers' AutoTokenizer, vLLM and SGLang at "
            "start-up). Fix the file, or remove it to export the model without it"
        )
    for where, problem in chat_template_problems(files)[:1]:
        raise InvalidConfigError(
            f"the chat template {where} of {os.fspath(source)} {problem}: the checkpoint "
            "would load, and every chat request (transformers' apply_chat_template, vLLM's "
            "and SGLang's chat endpoints) would fail. Fix the template, or remove it to "
            "export the model without one"
        )


def _saved(tokenizer: Any, scratch: Path | None) -> dict[str, bytes]:
    save = getattr(tokenizer, "save_pretrained", None)
    if not callable(save):
        raise InvalidOptionError(
            f"tokenizer must be a directory or an object with save_pretrained() (a "
            f"transformers tokenizer), got {type(tokenizer).__name__}"
        )
    with tempfile.TemporaryDirectory(dir=scratch, prefix=".tokenizer-") as tmp:
        folder = Path(tmp)
        save(str(folder))
        return {
            p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        }


def describe_tokenizer(tokenizer: Any) -> Any:
    """What the manifest records of ``tokenizer=``: the path as given, or the object's class."""
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    return f"<{type(tokenizer).__name__}>"


def write_payload(directory: Path, files: Mapping[str, bytes]) -> None:
    """Write ``files`` under ``directory`` (a staged checkpoint)."""
    for name, data in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
