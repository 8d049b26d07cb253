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
from typing import Literal

from exportlm.checkpoint import HF_QUANT_CONFIG_NAME, QuantizationDeclaration, declaration_of
from exportlm.errors import MalformedCheckpointError
from exportlm.hfdir import read_json_object
from exportlm.inspection._files import INDEX, read_json
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
    config = read_json(directory / "config.json")
    declaration = declaration_of(config, read_json(directory / HF_QUANT_CONFIG_NAME))
    return listed_in(declaration, bool(config.get("tie_word_embeddings")))


def listed_in(declaration: QuantizationDeclaration, tied: bool) -> list[ListedName]:
    """:func:`listed_names` of a declaration (``tied``: ``config.json`` ties the embeddings)."""
    listed = [
        ListedName(item.entry, item.where, item.excluded)
        for item in declaration.listed
        # of a group's targets, module paths only: class names ("Linear") and regexes over
        # classes are not names
        if not item.target or _is_module_path(item.entry)
    ]
    if tied:
        # A tied lm_head saves no tensor of its own (its weight is the saved input
        # embedding); ModelOpt lists it as excluded all the same, so that entry is valid.
        listed = [i for i in listed if not (i.excluded and i.entry.split(".")[-1] == "lm_head")]
    return listed


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
