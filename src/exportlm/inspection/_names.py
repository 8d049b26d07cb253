"""Module names in quantization configs versus the names the checkpoint saves.

The module names a quantization config lists (``hf_quant_config.json``'s
``exclude_modules`` and ``quantized_layers``, ``config.json``'s
``quantization_config`` ``ignore``, ``quantized_layers`` and module-name
``targets``) must be the names the checkpoint saves its tensors under, and no
quantized module may be listed as excluded. A loader that reads a stale
in-memory name (Mixtral ``model.layers.0.mlp.gate`` for the saved
``model.layers.0.block_sparse_moe.gate``) would otherwise quantize the router.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from exportlm.errors import MalformedCheckpointError
from exportlm.hfdir import read_json_object
from exportlm.inspection._files import HF_QUANT_CONFIG, INDEX, read_json
from exportlm.inspection._header import read_safetensors_header

__all__ = [
    "ListedName",
    "NameProblem",
    "checkpoint_name_problems",
    "listed_names",
    "name_problems",
    "saved_tensor_names",
]

_NEAREST = 3


@dataclass(frozen=True)
class ListedName:
    """One module name a quantization config lists.

    Attributes:
        entry: the name as written (a module path, an fnmatch wildcard or a
            compressed-tensors ``re:`` pattern).
        where: the file and key it comes from (``hf_quant_config.json: exclude_modules``).
        excluded: the list excludes the module (``exclude_modules`` / ``ignore``);
            ``False`` for a quantized-layer name.
    """

    entry: str
    where: str
    excluded: bool


@dataclass(frozen=True)
class NameProblem:
    """One wrong listed name.

    Attributes:
        kind: ``"unsaved"`` (names no saved tensor) or ``"excludes-quantized"``.
        item: the listed name.
        subject: the module it concerns (the entry, or the excluded quantized module).
        message: the explanation, with the nearest saved names.
    """

    kind: Literal["unsaved", "excludes-quantized"]
    item: ListedName
    subject: str
    message: str


def saved_tensor_names(directory: Path) -> list[str]:
    """Every tensor name of the checkpoint: the index's ``weight_map``, else the shards' headers.

    Raises :class:`~exportlm.errors.MalformedCheckpointError` naming the file when the
    index or a header is malformed.
    """
    index = directory / INDEX
    if index.is_file():
        weight_map = read_json_object(index, what="safetensors index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise MalformedCheckpointError(
                f"{index}: weight_map is {type(weight_map).__name__}, expected an object "
                "{tensor name: shard file}",
                path=index,
                field="weight_map",
            )
        return sorted(weight_map)
    names: list[str] = []
    for file in sorted(directory.glob("*.safetensors")):
        names.extend(read_safetensors_header(file))
    return sorted(names)


def listed_names(directory: Path) -> list[ListedName]:
    """The module names the checkpoint's quantization configs list (see the module docstring)."""
    return listed_in(read_json(directory / HF_QUANT_CONFIG), read_json(directory / "config.json"))


def listed_in(hf_quant_config: dict[str, Any], config: dict[str, Any]) -> list[ListedName]:
    """:func:`listed_names` of already-read ``hf_quant_config.json`` and ``config.json``."""
    listed: list[ListedName] = []
    quantization = _object(hf_quant_config.get("quantization"))
    where = f"{HF_QUANT_CONFIG}: quantization"
    listed += _entries(quantization.get("exclude_modules"), f"{where}.exclude_modules", True)
    listed += _entries(quantization.get("quantized_layers"), f"{where}.quantized_layers", False)
    section = _object(config.get("quantization_config"))
    where = "config.json: quantization_config"
    listed += _entries(section.get("ignore"), f"{where}.ignore", True)
    listed += _entries(section.get("exclude_modules"), f"{where}.exclude_modules", True)
    listed += _entries(section.get("quantized_layers"), f"{where}.quantized_layers", False)
    for group_name, group in _object(section.get("config_groups")).items():
        group_targets = group.get("targets") if isinstance(group, dict) else None
        if not isinstance(group_targets, list):
            continue
        # module paths only: class names ("Linear") and regexes over classes are not names
        modules = [t for t in group_targets if isinstance(t, str) and _is_module_path(t)]
        listed += _entries(modules, f"{where}.config_groups.{group_name}.targets", False)
    if config.get("tie_word_embeddings"):
        # A tied lm_head saves no tensor of its own (its weight is the saved input
        # embedding); ModelOpt lists it as excluded all the same, so that entry is valid.
        listed = [i for i in listed if not (i.excluded and i.entry.split(".")[-1] == "lm_head")]
    return listed


def _object(value: Any) -> dict[str, Any]:
    """``value`` if it is a JSON object, else ``{}`` (a malformed section is its own finding)."""
    return value if isinstance(value, dict) else {}


def _entries(value: Any, where: str, excluded: bool) -> list[ListedName]:
    """A JSON list (or a mapping's keys) of names as :class:`ListedName`."""
    if isinstance(value, dict):
        value = list(value)
    if not isinstance(value, list):
        return []
    return [ListedName(str(entry), where, excluded) for entry in value]


def _is_module_path(target: str) -> bool:
    return "." in target and not target.startswith("re:")


def module_paths(tensor_names: Iterable[str]) -> set[str]:
    """Every module path that is a prefix of a tensor name (``a.b.weight`` -> ``a``, ``a.b``)."""
    paths: set[str] = set()
    for name in tensor_names:
        paths.update(_ancestors(name))
    return paths


def _ancestors(name: str) -> list[str]:
    """``a.b.c`` -> ``["a", "a.b"]``: the module paths above ``name``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _is_pattern(entry: str) -> bool:
    return entry.startswith("re:") or any(c in entry for c in "*?[")


def _matches_pattern(entry: str, module: str) -> bool:
    """Whether pattern ``entry`` matches ``module`` (compressed-tensors ``re:`` uses ``re.match``)."""
    if entry.startswith("re:"):
        try:
            return re.match(entry[3:], module) is not None
        except re.error:
            return False
    return fnmatch.fnmatchcase(module, entry)


def _nearest(entry: str, modules: Iterable[str]) -> list[str]:
    plain = entry[3:] if entry.startswith("re:") else entry
    return difflib.get_close_matches(plain, sorted(modules), n=_NEAREST, cutoff=0.0)


def _unsaved(item: ListedName, modules: set[str]) -> str | None:
    """Why ``item`` names no saved tensor, or ``None`` when it names one."""
    if _is_pattern(item.entry):
        if any(_matches_pattern(item.entry, m) for m in modules):
            return None
        problem = "matches no saved module path"
    elif item.entry in modules:  # `entry + "."` prefixes a saved tensor name
        return None
    else:
        problem = f"names no saved tensor (no tensor starts with {item.entry + '.'!r})"
    nearest = ", ".join(_nearest(item.entry, modules)) or "(no tensors)"
    return (
        f"{item.where} lists {item.entry!r}, which {problem}; nearest saved module names: {nearest}"
    )


def excluding(module: str, excluded: Iterable[ListedName]) -> list[ListedName]:
    """The exclude entries that exclude ``module``: itself, a module above it, or a pattern."""
    above = {module, *_ancestors(module)}
    return [
        item
        for item in excluded
        if (
            _matches_pattern(item.entry, module) if _is_pattern(item.entry) else item.entry in above
        )
    ]


def name_problems(tensor_names: Iterable[str], listed: list[ListedName]) -> Iterator[NameProblem]:
    """Every wrong name of ``listed`` against the saved ``tensor_names`` (see :class:`NameProblem`)."""
    names = sorted(tensor_names)
    modules = module_paths(names)
    for item in listed:
        message = _unsaved(item, modules)
        if message is not None:
            yield NameProblem("unsaved", item, item.entry, message)
    excluded = [item for item in listed if item.excluded]
    quantized = [n.removesuffix(".weight_scale") for n in names if n.endswith(".weight_scale")]
    for module in quantized if excluded else ():
        for item in excluding(module, excluded):
            yield NameProblem(
                "excludes-quantized",
                item,
                module,
                f"{item.where} lists {item.entry!r}, which excludes the quantized module "
                f"{module!r} (it has a saved {module}.weight_scale): a loader would read its "
                "quantized codes as full-precision weights",
            )


def checkpoint_name_problems(directory: Path) -> list[str]:
    """Why the names listed by ``directory``'s quantization configs are wrong (empty: none).

    Every listed name (exclude / ignore entries, quantized-layer names) must be a
    module path of at least one saved tensor (``name + "."`` is a prefix of it; a
    wildcard or ``re:`` pattern must match a saved module path), and no quantized
    module (one with a saved ``weight_scale``) may be excluded.
    """
    problems = name_problems(saved_tensor_names(directory), listed_names(directory))
    return [problem.message for problem in problems]
