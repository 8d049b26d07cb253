"""Checkpoint checks (scope ``"target"``): what a quantized checkpoint directory says about itself.

``checkpoint_names``: the module names a quantization config lists
(``hf_quant_config.json``'s ``exclude_modules`` and ``quantized_layers``,
``config.json``'s ``quantization_config`` ``ignore``, ``quantized_layers`` and
module-name ``targets``) are the names the checkpoint saves its tensors under, and
no quantized module is listed as excluded. A loader that reads a stale in-memory
name (Mixtral ``model.layers.0.mlp.gate`` for the saved
``model.layers.0.block_sparse_moe.gate``) would otherwise quantize the router.

Everything is read from the files on disk: tensor names from the safetensors
index (or the shards' headers, with ``safetensors.safe_open``; no tensor is loaded)
and the JSON configs. :func:`checkpoint_name_problems` is usable on any checkpoint
directory without pytest.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from exportlm.errors import UnsupportedFormatError
from pytest_exportcheck.checks._api import CheckResult, TargetCase, check
from pytest_exportcheck.checks._common import CheckAbort, aborts_to_result, error_text
from pytest_exportcheck.checks._support import (
    build_case_model,
    default_model_name,
    export_instance,
    require_device,
    target_info,
)

__all__ = [
    "CHECKPOINT_RECIPE",
    "ListedName",
    "checkpoint_name_problems",
    "checkpoint_names",
    "listed_names",
    "saved_tensor_names",
]

#: The recipe ``checkpoint_names`` quantizes the toy model with.
CHECKPOINT_RECIPE = "fp8"
_INDEX = "model.safetensors.index.json"
_HF_QUANT_CONFIG = "hf_quant_config.json"
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


# ----------------------------------------------------------------------------- reading the files


def saved_tensor_names(directory: Path) -> list[str]:
    """Every tensor name of the checkpoint: the index's ``weight_map``, else the shards' headers."""
    index = directory / _INDEX
    if index.is_file():
        return sorted(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    names: list[str] = []
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.extend(f.keys())
    return sorted(names)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def listed_names(directory: Path) -> list[ListedName]:
    """The module names the checkpoint's quantization configs list (see the module docstring)."""
    listed: list[ListedName] = []
    quantization = _read_json(directory / _HF_QUANT_CONFIG).get("quantization") or {}
    where = f"{_HF_QUANT_CONFIG}: quantization"
    listed += _entries(quantization.get("exclude_modules"), f"{where}.exclude_modules", True)
    listed += _entries(quantization.get("quantized_layers"), f"{where}.quantized_layers", False)
    config = _read_json(directory / "config.json").get("quantization_config") or {}
    where = "config.json: quantization_config"
    listed += _entries(config.get("ignore"), f"{where}.ignore", True)
    listed += _entries(config.get("exclude_modules"), f"{where}.exclude_modules", True)
    listed += _entries(config.get("quantized_layers"), f"{where}.quantized_layers", False)
    for group_name, group in (config.get("config_groups") or {}).items():
        group_targets = group.get("targets") if isinstance(group, dict) else None
        # module paths only: class names ("Linear") and regexes over classes are not names
        modules = [t for t in group_targets or [] if isinstance(t, str) and _is_module_path(t)]
        listed += _entries(modules, f"{where}.config_groups.{group_name}.targets", False)
    return listed


def _entries(value: Any, where: str, excluded: bool) -> list[ListedName]:
    """A JSON list (or a mapping's keys) of names as :class:`ListedName`."""
    if isinstance(value, dict):
        value = list(value)
    if not isinstance(value, list):
        return []
    return [ListedName(str(entry), where, excluded) for entry in value]


def _is_module_path(target: str) -> bool:
    return "." in target and not target.startswith("re:")


# ----------------------------------------------------------------------------- matching


def _module_paths(tensor_names: Iterable[str]) -> set[str]:
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


def _excluding(module: str, excluded: list[ListedName]) -> list[ListedName]:
    """The exclude entries that exclude ``module``: itself, a module above it, or a pattern."""
    above = {module, *_ancestors(module)}
    return [
        item
        for item in excluded
        if (
            _matches_pattern(item.entry, module) if _is_pattern(item.entry) else item.entry in above
        )
    ]


def checkpoint_name_problems(directory: Path) -> list[str]:
    """Why the names listed by ``directory``'s quantization configs are wrong (empty: none).

    Every listed name (exclude / ignore entries, quantized-layer names) must be a
    module path of at least one saved tensor (``name + "."`` is a prefix of it; a
    wildcard or ``re:`` pattern must match a saved module path), and no quantized
    module (one with a saved ``weight_scale``) may be excluded.
    """
    tensor_names = saved_tensor_names(directory)
    modules = _module_paths(tensor_names)
    listed = listed_names(directory)
    problems = [p for p in (_unsaved(item, modules) for item in listed) if p is not None]
    excluded = [item for item in listed if item.excluded]
    quantized = sorted(
        name.removesuffix(".weight_scale")
        for name in tensor_names
        if name.endswith(".weight_scale")
    )
    for module in quantized if excluded else ():
        for item in _excluding(module, excluded):
            problems.append(
                f"{item.where} lists {item.entry!r}, which excludes the quantized module "
                f"{module!r} (it has a saved {module}.weight_scale): a loader would read its "
                "quantized codes as full-precision weights"
            )
    return problems


# ----------------------------------------------------------------------------- the check


def _quantized_toy(case: TargetCase, name: str) -> nn.Module:
    from exportlm.quant import quantize

    model = build_case_model(case, name)
    try:
        quantized: nn.Module = quantize(model, CHECKPOINT_RECIPE)
    except UnsupportedFormatError as err:
        raise CheckAbort(
            CheckResult.skipped(f"{CHECKPOINT_RECIPE} does not fit toy model {name!r}: {err}")
        ) from err
    except Exception as err:
        raise CheckAbort(
            CheckResult.failed(
                f"quantizing {name!r} with {CHECKPOINT_RECIPE} raised {error_text(err)}",
                exception=err,
            )
        ) from err
    return quantized


def _counts(items: Iterable[ListedName]) -> dict[str, int]:
    """How many names each file and key lists (for the report)."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item.where] = counts.get(item.where, 0) + 1
    return counts


@check("checkpoint_names")
@aborts_to_result
def checkpoint_names(case: TargetCase) -> CheckResult:
    """Names in a quantized checkpoint's configs are the names its tensors are saved under.

    For a target declaring ``quantized`` and ``artifact="directory"``: the toy model,
    quantized with FP8, is exported (``case.export_instance``, cached) and read back
    from disk. Every ``exclude_modules`` / ``ignore`` entry and every
    ``quantized_layers`` key (and module-name ``targets``) of ``hf_quant_config.json``
    and ``config.json``'s ``quantization_config`` must be a module path of a saved
    tensor (from the safetensors index or headers), and no module with a saved
    ``weight_scale`` may be excluded. A file-artifact target is a counted skip.
    """
    info = target_info(case)
    require_device(case, info)
    if not info.has("quantized"):  # the plugin counts this gap itself; a script gets it here
        return CheckResult.skipped(
            f"capability gap: target {case.target_id!r} does not declare 'quantized'"
        )
    if info.artifact != "directory":
        return CheckResult.skipped(
            f"target {case.target_id!r} writes a single file (artifact={info.artifact!r}); "
            "checkpoint_names reads a checkpoint directory (safetensors + JSON configs)"
        )
    name = default_model_name(case)
    model = _quantized_toy(case, name)
    path = export_instance(case, model, case.workdir / "checkpoint_names")
    if not path.is_dir():
        return CheckResult.failed(
            f"{case.target_id} declares artifact='directory' but returned {path}, not a directory"
        )
    tensor_names = saved_tensor_names(path)
    if not tensor_names:
        return CheckResult.failed(
            f"the {CHECKPOINT_RECIPE} checkpoint of {name!r} ({path.name}) holds no safetensors "
            f"tensors ({_INDEX} or *.safetensors)"
        )
    listed = listed_names(path)
    if not listed:
        return CheckResult.skipped(
            f"the {CHECKPOINT_RECIPE} checkpoint of {name!r} lists no module names "
            f"({_HF_QUANT_CONFIG} / config.json quantization_config): nothing to check"
        )
    problems = checkpoint_name_problems(path)
    if problems:
        return CheckResult.failed(
            f"{case.target_id} {CHECKPOINT_RECIPE} checkpoint of {name!r}: " + "; ".join(problems),
            problems=problems,
        )
    return CheckResult.passed(
        f"{len(listed)} listed name(s) name saved tensors; no quantized module is excluded",
        listed=_counts(listed),
        tensors=len(tensor_names),
    )
