"""``--quantize RECIPE[:options]`` and ``--exclude``: the recipe, checked before any work.

The recipe's names and options, the checkpoint layout it is written in and the shapes
of the model's modules are checked before the model is loaded, the calibration data is
read or a forward runs: a refusal costs the CLI's start-up, not a calibration. The
shapes come from a skeleton of a model directory on the ``meta`` device (built from its
``config.json``, no weights read, the one a streamed export then reads into; for dense
Llama-style configs first from the config's numbers alone, without importing
transformers: :mod:`exportlm.cli._config_skeleton`); a
toy family or spec file is checked once built, still before calibration. Either refusal
is a usage error (exit code 2), as a layout that cannot hold the recipe is.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from exportlm.cli._errors import UsageError
from exportlm.cli._model import ModelSource

__all__ = [
    "check_model_layout",
    "check_model_recipe",
    "check_recipe_on",
    "parsed_recipe",
    "checked_recipe",
    "warn_unmatched_excludes",
]

logger = logging.getLogger(__name__)


def checked_recipe(args: argparse.Namespace, options: dict[str, Any]) -> Any:
    """The :class:`~exportlm.quant.QuantRecipe` of ``--quantize`` / ``--exclude``, or ``None``.

    Raises:
        UsageError: ``--exclude`` without ``--quantize``, or a malformed recipe.
        UnknownNameError, UnknownOptionError: an unknown recipe or option.
        UsageError: also ``--target hf_checkpoint`` in a layout (``-o format=``) that
            cannot hold the recipe's formats, naming the one that can (exit code 2).

    For ``--target hf_checkpoint`` the recipe takes the scale convention of its layout
    (:meth:`~exportlm.quant.QuantRecipe.for_layout`): ``-o format=compressed-tensors``
    computes the scales as compressed-tensors does, so the checkpoint is the
    calibrated model exactly; a ``scales=`` the command line spells is kept.
    """
    recipe = parsed_recipe(args)
    if recipe is None:
        return None
    from exportlm.quant import check_layout
    from exportlm.quant.formats import DEFAULT_LAYOUT, checkpoint_layout

    if args.target == "hf_checkpoint":
        layout = str(options.get("format", DEFAULT_LAYOUT))
        try:
            check_layout(recipe, layout)
        except ValueError as err:  # a layout that cannot hold the recipe (an
            # UnsupportedFormatError), or an unknown layout name: both are the command line's
            raise UsageError(f"-o format={layout}: {err}") from err
        converted = recipe.for_layout(layout)
        only = checkpoint_layout(layout).quantized_modules  # gpt-oss-mxfp4: the experts
        if only and recipe.algo is not None:
            logger.info(
                "--quantize %s: quantizes only %s (what -o format=%s holds; the rest stays float)",
                args.quantize,
                ", ".join(only),
                layout,
            )
        elif converted != recipe:
            logger.info(
                "--quantize %s: scales computed as %s computes them (%s), so the "
                "checkpoint holds the calibrated model exactly",
                args.quantize,
                layout,
                converted.algo or ", ".join(a or "-" for _, a in converted.overrides),
            )
        return converted
    return recipe


def parsed_recipe(args: argparse.Namespace) -> Any:
    """``--quantize`` (with ``--exclude``) as a :class:`~exportlm.quant.QuantRecipe`, or
    ``None`` without it; a recipe that does not parse is a :class:`UsageError` (exit 2)."""
    exclude = list(getattr(args, "exclude", None) or [])
    if args.quantize is None:
        if exclude:
            raise UsageError("--exclude: only used with --quantize RECIPE")
        return None
    from exportlm.errors import UnknownNameError, UnknownOptionError
    from exportlm.quant import QuantRecipe

    try:
        return QuantRecipe.parse(args.quantize, exclude)
    except (UnknownNameError, UnknownOptionError):
        raise
    except ValueError as err:
        raise UsageError(f"--quantize {args.quantize}: {err}") from err


def check_model_recipe(source: ModelSource, recipe: Any) -> Any:
    """Refuse, from a model directory's ``config.json`` alone, a module the recipe cannot take.

    Returns the directory's ``meta`` model the recipe was checked on (a streamed export
    reads into it: :class:`~exportlm.export.hf_checkpoint.directory.ModelDirectory`), or
    ``None``: another source (checked by :func:`~exportlm.cli._calib.quantize_model` once
    built), or a config transformers cannot build (loading reports why).
    """
    if source.kind != "directory" or source.path is None:
        return None
    from exportlm.export.hf_checkpoint.directory import meta_skeleton

    fast = _config_skeleton(source.path)
    if fast is not None:  # refuses without importing transformers; a pass is checked again
        check_recipe_on(fast, recipe)
    skeleton = meta_skeleton(source.path)  # vetted by resolve_model
    if skeleton is not None:
        check_recipe_on(skeleton, recipe)
        warn_unmatched_excludes(skeleton, recipe)
    return skeleton


def warn_unmatched_excludes(model: Any, recipe: Any) -> None:
    """Warn of each ``--exclude`` pattern that matches no module name of ``model``.

    Such a pattern excludes nothing, so a typo (``'*down_porj'``) quantized the modules it
    was meant to keep, and the export said nothing. A warning, not a refusal: a script may
    pass one list of patterns to models that do not all have every module.
    """
    import fnmatch

    from torch import nn

    patterns = tuple(getattr(recipe, "exclude", None) or ())
    if not patterns:
        return
    names = [name for name, _ in model.named_modules() if name]
    linear = next((n for n, m in model.named_modules() if isinstance(m, nn.Linear)), None)
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            logger.warning(
                "--exclude %r matches no module of %s, so it excludes nothing; patterns are "
                "fnmatch patterns of module names%s",
                pattern,
                type(model).__name__,
                f" (such as {linear!r}, matched by '*{linear.rpartition('.')[2]}')"
                if linear
                else "",
            )


def check_recipe_on(model: Any, recipe: Any) -> bool:
    """:func:`~exportlm.quant.check_recipe`, its refusal the command line's (exit code 2:
    the same ``--quantize`` fails again on this model until it changes, as the message says).

    Returns whether the recipe runs calibration forwards.
    """
    from exportlm.errors import UnsupportedFormatError
    from exportlm.quant import check_recipe

    try:
        return check_recipe(model, recipe)
    except UnsupportedFormatError as err:
        raise UsageError(f"--quantize: {err}") from err


def check_model_layout(
    target: str, options: dict[str, Any], source: ModelSource, model: Any
) -> None:
    """Refuse a model the ``hf_checkpoint`` layout (``-o format=``) cannot hold (gpt-oss-mxfp4:
    a ``gpt_oss`` model only), before loading (a directory: its ``config.json``'s
    ``model_type``) or quantizing (``model``, once built). Exit code 2."""
    if target != "hf_checkpoint":
        return
    from exportlm.quant import check_layout_model, check_layout_model_type
    from exportlm.quant.formats import DEFAULT_LAYOUT

    layout = str(options.get("format", DEFAULT_LAYOUT))
    try:
        if model is not None:
            check_layout_model(model, layout)
        elif source.kind == "directory" and source.path is not None:
            from exportlm.hfdir import read_config

            model_type = read_config(source.path).get("model_type")
            check_layout_model_type(model_type, layout, str(source.path))
    except ValueError as err:  # an UnsupportedFormatError: the command line's
        raise UsageError(f"-o format={layout}: {err}") from err


def _config_skeleton(path: Path) -> Any:
    """The linears of a dense Llama-style directory from ``config.json`` alone, else ``None``."""
    from exportlm.cli._config_skeleton import config_skeleton
    from exportlm.hfdir import read_config
    from exportlm.source_config import missing_layers

    try:
        config = read_config(path)
    except (OSError, ValueError):  # the full skeleton (then loading) reports it
        return None
    if missing_layers(path, config) is not None:  # 10**9 layers: the full skeleton refuses
        return None
    return config_skeleton(config)
