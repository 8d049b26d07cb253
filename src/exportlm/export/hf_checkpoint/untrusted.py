"""What the ``hf_checkpoint`` loader checks in a directory before transformers or safetensors see it.

A checkpoint directory may come from anywhere, manifest or not, so every file is
read as untrusted input and every defect is an exportlm error naming the file
(and the field or tensor), never a dependency's exception:

* ``config.json`` and ``hf_quant_config.json``: JSON objects
  (:func:`exportlm.hfdir.read_json_object`), the model config's fields of the types
  and values its architecture's config class declares and the quantization
  declaration known (the rules ``config-*`` and ``quant-algo-unknown`` of
  :mod:`exportlm.inspection`), and no code of its own
  (:func:`exportlm.hfdir.refuse_custom_code`);
* the index: a JSON object whose ``weight_map`` names shard files inside the
  directory (no absolute path, no ``..``, no symbolic link out of it), each holding
  exactly the tensors the index assigns to it;
* every shard's safetensors header, parsed and validated by exportlm
  (:func:`exportlm.inspection.read_safetensors_header`: dtypes, shapes, offsets
  inside the file, no overlap or gap) before ``safetensors.safe_open`` maps it; an
  error safetensors still raises is re-raised naming the file.

The same checks are the error-level file rules of ``exportlm inspect``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exportlm.checkpoint import read_declaration
from exportlm.errors import MalformedCheckpointError, UnknownQuantAlgoError
from exportlm.export.hf_checkpoint.sink import INDEX_NAME, SINGLE_FILE_NAME
from exportlm.hfdir import (
    CONFIG_NAME,
    read_config,
    read_json_object,
    refuse_custom_code,
    shard_name_problem,
)
from exportlm.inspection import (
    config_field_problems,
    layer_gap,
    quant_config_problems,
    read_safetensors_header,
)

__all__ = [
    "StoredTensors",
    "check_layer_count",
    "check_shapes",
    "read_model_config",
    "read_stored_tensors",
]


def read_model_config(directory: Path) -> dict[str, Any]:
    """``config.json`` of ``directory``, after every config check (see the module docstring).

    Raises:
        MalformedCheckpointError: a config is missing, not a JSON object, or has a
            field of the wrong type or value, or an unknown ``quant_algo`` / scheme.
        CustomCodeRefusedError: loading would run the directory's own code.
        NotRegularFileError: a config is a FIFO, a device or a directory.
    """
    config_path = directory / CONFIG_NAME
    try:
        config = read_config(directory)
    except FileNotFoundError as err:
        raise MalformedCheckpointError(
            f"{directory} is not a Hugging Face checkpoint: it has no {CONFIG_NAME}; copy it "
            "along with the shards",
            path=config_path,
        ) from err
    problems = config_field_problems(config)
    if problems:
        field, message = problems[0]
        raise MalformedCheckpointError(
            f"{message}. Fix {config_path} or export the model again", path=config_path, field=field
        )
    refuse_custom_code(directory, config)
    quant_problems = quant_config_problems(read_declaration(directory, config))
    if quant_problems:
        rule, subject, message = quant_problems[0]
        if rule == "quant-algo-unknown":
            raise UnknownQuantAlgoError(
                f"{directory / subject}: {message}", path=directory / subject, field="quant_algo"
            )
        raise MalformedCheckpointError(
            message, path=directory / subject, field="quantization_config"
        )
    return config


@dataclass(frozen=True)
class StoredTensors:
    """Every tensor of a checkpoint and the shard each came from (for error messages)."""

    tensors: dict[str, torch.Tensor]
    files: dict[str, Path]

    def file_of(self, name: str | None) -> Path | None:
        """The shard holding tensor ``name`` (``None`` when unknown)."""
        return self.files.get(name) if name is not None else None


def _confined(directory: Path, name: str, index: Path) -> Path:
    why = shard_name_problem(directory, name)
    if why is not None:
        raise MalformedCheckpointError(
            f"{index} names shard {why}: exportlm reads only files inside the checkpoint "
            "directory. Shard names are plain file names next to the index (copy linked "
            "files in, e.g. cp -rL)",
            path=index,
            field=name,
        )
    return directory / name


def _indexed_shards(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The shard files to read and, with an index, its ``weight_map``."""
    index = directory / INDEX_NAME
    if not os.path.lexists(index):
        single = directory / SINGLE_FILE_NAME
        if not os.path.lexists(single):
            raise MalformedCheckpointError(
                f"{directory} holds neither {SINGLE_FILE_NAME} nor {INDEX_NAME}: no weights to "
                "load",
                path=single,
            )
        return [_confined(directory, SINGLE_FILE_NAME, single)], None
    weight_map = read_json_object(index, what="safetensors index").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise MalformedCheckpointError(
            f"{index}: weight_map is {type(weight_map).__name__}, expected an object "
            "{tensor name: shard file name}; rewrite the index from the shards' headers",
            path=index,
            field="weight_map",
        )
    files = [_confined(directory, name, index) for name in sorted(set(weight_map.values()))]
    for file in files:
        if not os.path.lexists(file):
            raise MalformedCheckpointError(
                f"{index} names shard {file.name}, which does not exist in {directory}; the "
                "checkpoint is incomplete (copy every shard the index lists)",
                path=file,
            )
    return files, weight_map


def _check_index(index: Path, weight_map: dict[str, str], held: dict[str, Path]) -> None:
    for name, shard in sorted(weight_map.items()):
        if name not in held or held[name].name != Path(shard).name:
            where = f"{held[name].name} holds it" if name in held else "no shard holds it"
            raise MalformedCheckpointError(
                f"{index} maps tensor {name} to {shard}, but {where}; rewrite the index from "
                "the shards' headers",
                path=index,
                field=name,
            )
    for name in sorted(set(held) - set(weight_map))[:1]:
        raise MalformedCheckpointError(
            f"{held[name].name} holds tensor {name}, which {index.name} does not list "
            "(loaders would never load it); rewrite the index from the shards' headers",
            path=index,
            field=name,
        )


def read_stored_tensors(directory: Path) -> StoredTensors:
    """Every tensor of ``directory``'s shards, each header validated before it is opened.

    Raises :class:`MalformedCheckpointError` naming the file (and the tensor) for a
    malformed index or header, a shard outside the directory, a tensor in two
    shards, or a file safetensors cannot read; :class:`NotRegularFileError` for a
    FIFO / device / directory.
    """
    files, weight_map = _indexed_shards(directory)
    held: dict[str, Path] = {}
    for file in files:
        for name in read_safetensors_header(file):
            if name in held:
                raise MalformedCheckpointError(
                    f"tensor {name} is saved in both {held[name].name} and {file.name}; a "
                    "checkpoint saves each tensor once",
                    path=file,
                    field=name,
                )
            held[name] = file
    if weight_map is not None:
        _check_index(directory / INDEX_NAME, weight_map, held)
    return StoredTensors(_load(files), held)


def _load(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    tensors[key] = f.get_tensor(key)
        except (SafetensorError, OSError, RuntimeError, ValueError) as err:
            raise MalformedCheckpointError(
                f"{file}: safetensors cannot read it ({err}); the file is corrupted or was "
                "changed while loading. Export or download it again",
                path=file,
            ) from err
    return tensors


def check_layer_count(config: Any, stored: StoredTensors) -> None:
    """Refuse a ``num_hidden_layers`` that disagrees with the stored layers, before a model exists.

    A config may ask for a million layers with the tensors of two: transformers would
    build (and randomly initialise) them all; a layer missing from the shards would be
    built from random weights, silently. The rule is ``exportlm inspect``'s
    ``layer-missing`` (:func:`exportlm.inspection.layer_gap`); layouts whose names show
    no layer indices are left to :func:`check_shapes`.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    gap = layer_gap(getattr(text, "num_hidden_layers", None), stored.tensors)
    if gap is None:
        return
    raise MalformedCheckpointError(
        gap.message(),
        path=next(iter(stored.files.values())).parent / CONFIG_NAME,
        field="num_hidden_layers",
    )


def check_shapes(skeleton: Any, weights: dict[str, torch.Tensor], stored: StoredTensors) -> None:
    """Refuse a weight whose shape is not its parameter's in ``skeleton`` (an empty model).

    Compares names the model has as they are (names transformers converts on load,
    Mixtral's split experts, are checked by transformers itself).
    """
    expected = skeleton.state_dict()
    for name, tensor in sorted(weights.items()):
        want = expected.get(name)
        if want is None or tuple(want.shape) == tuple(tensor.shape):
            continue
        file = stored.file_of(name) or stored.file_of(f"{name.rpartition('.')[0]}.weight")
        # a parameter stored as its leaves (gpt-oss's gate_up_proj_blocks)
        file = file or next((f for n, f in stored.files.items() if n.startswith(f"{name}_")), None)
        raise MalformedCheckpointError(
            f"{file}: tensor {name} has shape {list(tensor.shape)}, but the model config.json "
            f"describes has {list(want.shape)} there; the header or config.json is wrong",
            path=file,
            field=name,
        )
