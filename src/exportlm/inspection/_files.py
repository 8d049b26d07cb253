"""Reading a checkpoint directory without loading its tensors.

Each ``*.safetensors`` header is parsed by :mod:`~exportlm.inspection._header`
(the 8-byte length and the JSON header, never the data), so a multi-gigabyte
checkpoint is inspected from a few kilobytes per shard; the index and the JSON
configs are read with :mod:`exportlm.hfdir`. Every file is opened through
:mod:`exportlm.safeio`: a FIFO or a device raises
:class:`~exportlm.errors.NotRegularFileError` instead of blocking. Tensor values
are read (with ``safetensors.safe_open``) only for the rules that need them:
scales, which are tiny, and only from shards whose header is sound.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch

from exportlm.checkpoint import HF_QUANT_CONFIG_NAME, QuantizationDeclaration, declaration_of
from exportlm.errors import InvalidInputError, MalformedCheckpointError
from exportlm.hfdir import read_json_object
from exportlm.inspection._header import HeaderProblem, TensorInfo, parse_safetensors_header

__all__ = [
    "CONFIG",
    "HF_QUANT_CONFIG",
    "INDEX",
    "Checkpoint",
    "escape_problem",
    "read_checkpoint",
    "read_json",
    "safetensors_dtype",
]

INDEX = "model.safetensors.index.json"
HF_QUANT_CONFIG = HF_QUANT_CONFIG_NAME
CONFIG = "config.json"

_TORCH_TO_SAFETENSORS = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.int64: "I64",
    torch.float64: "F64",
}
#: The safetensors dtypes of floating-point tensors that a float32 scale may be cast to.
FLOAT_SCALE_DTYPES = frozenset({"F32", "F16", "BF16"})


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors header string of ``dtype`` (``torch.float8_e4m3fn`` -> ``"F8_E4M3"``)."""
    return _TORCH_TO_SAFETENSORS.get(dtype, str(dtype).removeprefix("torch."))


def escape_problem(directory: Path, name: str, *, follow_links: bool) -> str | None:
    """Why file name ``name`` (from an index or a config) reaches outside ``directory``, or ``None``.

    An absolute path (POSIX or Windows), a ``..`` component, or (``follow_links``)
    a path whose symbolic links resolve outside ``directory``.
    """
    if not name or "\x00" in name:
        return f"{name!r} is not a file name"
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute() or name[:1] == "\\":
        return f"{name!r} is an absolute path"
    if ".." in PurePosixPath(name.replace("\\", "/")).parts:
        return f"{name!r} climbs out of the directory ('..')"
    if follow_links:
        root = os.path.realpath(directory)
        target = os.path.realpath(directory / name)
        if os.path.commonpath([root, target]) != root:
            return f"{name!r} is a symbolic link to {target}, outside {directory}"
    return None


@dataclass
class Checkpoint:
    """What a checkpoint directory holds, read from headers and JSON files only.

    Attributes:
        directory: the checkpoint directory.
        tensors: every well-formed tensor by name (the first shard holding it, in file order).
        locations: every shard holding each tensor (more than one is a defect).
        shards: the ``*.safetensors`` files read, sorted.
        shard_problems: ``{file: problems}`` of shards whose header is not sound.
        index: the index's ``weight_map`` (tensor -> shard), ``None`` without an index.
        index_problem: why the index could not be read, or ``None``.
        index_escapes: ``{tensor: why}`` of index entries naming a file outside the directory.
        config: ``config.json`` (``{}`` when absent or unreadable).
        hf_quant_config: ``hf_quant_config.json`` (``{}`` when absent or unreadable).
        config_problems: ``{file: why}`` of JSON configs that are missing or unreadable.
    """

    directory: Path
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    locations: dict[str, list[str]] = field(default_factory=dict)
    shards: list[str] = field(default_factory=list)
    shard_problems: dict[str, tuple[HeaderProblem, ...]] = field(default_factory=dict)
    index: dict[str, str] | None = None
    index_problem: str | None = None
    index_escapes: dict[str, str] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    hf_quant_config: dict[str, Any] = field(default_factory=dict)
    config_problems: dict[str, str] = field(default_factory=dict)

    @property
    def unreadable(self) -> dict[str, str]:
        """``{file: first problem}`` of the shards whose header is not sound."""
        return {file: problems[0].message for file, problems in self.shard_problems.items()}

    def readable(self, name: str) -> bool:
        """Tensor ``name`` lies in a shard whose header is sound (its values can be read)."""
        info = self.tensors.get(name)
        return info is not None and info.file not in self.shard_problems

    def values(self, name: str) -> torch.Tensor:
        """The stored values of tensor ``name`` (read from its shard; use for small tensors)."""
        return next(v for _, v in self.iter_values([name]))

    def iter_values(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, values)`` of each of ``names``, one tensor in memory at a time, each shard
        opened once.

        Raises :class:`~exportlm.errors.MalformedCheckpointError` naming the shard when
        safetensors cannot read it.
        """
        from safetensors import SafetensorError, safe_open

        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.tensors[name].file, []).append(name)
        for file, in_file in sorted(by_file.items()):
            path = self.directory / file
            try:
                with safe_open(str(path), framework="pt") as f:
                    loaded = [(name, f.get_tensor(name)) for name in in_file]
            except (SafetensorError, OSError, RuntimeError, ValueError) as err:
                raise MalformedCheckpointError(
                    f"{file}: safetensors cannot read it ({err}); the file is corrupted",
                    path=path,
                ) from err
            yield from loaded

    @property
    def declaration(self) -> QuantizationDeclaration:
        """What ``config.json`` and ``hf_quant_config.json`` declare about the quantization
        (:func:`exportlm.checkpoint.declaration_of`)."""
        return declaration_of(self.config, self.hf_quant_config)


def read_checkpoint(directory: Path) -> Checkpoint:
    """Read ``directory``'s shard headers, index and JSON configs (no tensor data).

    Raises :class:`~exportlm.errors.InvalidInputError` when ``directory`` holds no
    ``*.safetensors`` file and no index (it is not a safetensors checkpoint), and
    :class:`~exportlm.errors.NotRegularFileError` when a file it reads is a FIFO, a
    device or a directory. Defects of the files are recorded, never raised.
    """
    checkpoint = Checkpoint(directory)
    checkpoint.shards = sorted(p.name for p in directory.glob("*.safetensors"))
    if not checkpoint.shards and not os.path.lexists(directory / INDEX):
        raise InvalidInputError(
            f"{directory} holds no *.safetensors file and no {INDEX}; expected a Hugging Face "
            "safetensors checkpoint directory (or pass an .onnx file)"
        )
    for shard in checkpoint.shards:
        try:
            header = parse_safetensors_header(directory / shard)
        except FileNotFoundError as err:  # a dangling link
            problem = HeaderProblem("shard-unreadable", None, f"{shard}: cannot be read ({err})")
            checkpoint.shard_problems[shard] = (problem,)
            continue
        if header.problems:
            checkpoint.shard_problems[shard] = header.problems
        for name, info in header.tensors.items():
            checkpoint.tensors.setdefault(name, info)
            checkpoint.locations.setdefault(name, []).append(shard)
    _read_index(checkpoint)
    checkpoint.config = _read_config(checkpoint, CONFIG, required=True)
    checkpoint.hf_quant_config = _read_config(checkpoint, HF_QUANT_CONFIG, required=False)
    return checkpoint


def _read_config(checkpoint: Checkpoint, name: str, *, required: bool) -> dict[str, Any]:
    try:
        return read_json_object(checkpoint.directory / name, what=name)
    except FileNotFoundError:
        if required:
            checkpoint.config_problems[name] = (
                f"{name} is missing: every loader builds the model from it. Copy it along "
                "with the shards"
            )
    except MalformedCheckpointError as err:
        checkpoint.config_problems[name] = str(err)
    return {}


def _read_index(checkpoint: Checkpoint) -> None:
    path = checkpoint.directory / INDEX
    try:
        data = read_json_object(path, what="safetensors index")
    except FileNotFoundError:
        return
    except MalformedCheckpointError as err:
        checkpoint.index_problem = str(err)
        return
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict):
        checkpoint.index_problem = (
            f"{INDEX}: weight_map is {type(weight_map).__name__}, expected an object "
            "{tensor name: shard file}"
        )
        return
    bad = [k for k, v in weight_map.items() if not isinstance(v, str)]
    if bad:
        checkpoint.index_problem = (
            f"{INDEX}: weight_map[{bad[0]!r}] is {weight_map[bad[0]]!r}, expected a shard file name"
        )
        return
    checkpoint.index = dict(weight_map)
    for name, shard in sorted(weight_map.items()):
        why = escape_problem(checkpoint.directory, shard, follow_links=False)
        if why is not None:
            checkpoint.index_escapes[name] = why


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, ``{}`` when absent or malformed.

    A FIFO, a device or a directory raises :class:`~exportlm.errors.NotRegularFileError`.
    """
    try:
        return read_json_object(path, what=path.name)
    except (FileNotFoundError, MalformedCheckpointError):
        return {}
