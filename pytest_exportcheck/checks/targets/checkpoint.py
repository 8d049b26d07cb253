"""Checkpoint checks (scope ``"target"``): what a quantized checkpoint directory says about itself.

``checkpoint_names``: the module names a quantization config lists
(``hf_quant_config.json``'s ``exclude_modules`` and ``quantized_layers``,
``config.json``'s ``quantization_config`` ``ignore``, ``quantized_layers`` and
module-name ``targets``) are the names the checkpoint saves its tensors under, and
no quantized module is listed as excluded. A loader that reads a stale in-memory
name (Mixtral ``model.layers.0.mlp.gate`` for the saved
``model.layers.0.block_sparse_moe.gate``) would otherwise quantize the router.

Everything is read from the files on disk: tensor names from the safetensors
index (or the shards' headers, parsed without loading a tensor)
and the JSON configs. :func:`checkpoint_name_problems` is usable on any checkpoint
directory without pytest; it lives in :mod:`exportlm.inspection` (re-exported
here), with the other rules of ``exportlm inspect``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

from exportlm.errors import UnsupportedFormatError
from exportlm.export import TargetInfo
from exportlm.inspection import (
    ListedName,
    checkpoint_name_problems,
    listed_names,
    saved_tensor_names,
)
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
    "require_checkpoint_target",
    "CHECKPOINT_RECIPE",
    "ListedName",
    "checkpoint_name_problems",
    "checkpoint_names",
    "listed_names",
    "quantized_toy",
    "saved_tensor_names",
]

#: The recipe ``checkpoint_names`` quantizes the toy model with.
CHECKPOINT_RECIPE = "fp8"
_INDEX = "model.safetensors.index.json"
_HF_QUANT_CONFIG = "hf_quant_config.json"


# ----------------------------------------------------------------------------- the check


def quantized_toy(
    case: TargetCase, name: str, recipe: str = CHECKPOINT_RECIPE, exclude: Sequence[str] = ()
) -> nn.Module:
    """Toy model ``name`` quantized with ``recipe`` (``exclude``: modules left unquantized):
    a counted skip when the recipe does not fit the model, a failure when quantizing raises
    anything else."""
    from exportlm.quant import quantize

    model = build_case_model(case, name)
    try:
        quantized: nn.Module = quantize(model, recipe, exclude=list(exclude) or None)
    except UnsupportedFormatError as err:
        raise CheckAbort(
            CheckResult.skipped(f"{recipe} does not fit toy model {name!r}: {err}")
        ) from err
    except Exception as err:
        raise CheckAbort(
            CheckResult.failed(
                f"quantizing {name!r} with {recipe} raised {error_text(err)}", exception=err
            )
        ) from err
    return quantized


def _counts(items: Iterable[ListedName]) -> dict[str, int]:
    """How many names each file and key lists (for the report)."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item.where] = counts.get(item.where, 0) + 1
    return counts


def require_checkpoint_target(case: TargetCase, check_id: str) -> TargetInfo:
    """The target's declaration; a counted skip unless it writes quantized checkpoint directories.

    For checks that read a checkpoint directory (safetensors + JSON configs): a target
    not declaring ``quantized`` is a capability gap, a file-artifact target a skip naming
    ``check_id``.
    """
    info = target_info(case)
    require_device(case, info)
    if not info.has("quantized"):  # the plugin counts this gap itself; a script gets it here
        raise CheckAbort(
            CheckResult.skipped(
                f"capability gap: target {case.target_id!r} does not declare 'quantized'"
            )
        )
    if info.artifact != "directory":
        raise CheckAbort(
            CheckResult.skipped(
                f"target {case.target_id!r} writes a single file (artifact={info.artifact!r}); "
                f"{check_id} reads a checkpoint directory (safetensors + JSON configs)"
            )
        )
    return info


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
    require_checkpoint_target(case, "checkpoint_names")
    name = default_model_name(case)
    model = quantized_toy(case, name)
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
