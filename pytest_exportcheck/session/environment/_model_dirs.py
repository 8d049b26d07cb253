"""``--export-model PATH``: the user's own model directories, registered as model families.

Each directory becomes a family (``exportlm.models.directory``) before the registries are
read, in the controller and in every xdist worker alike, so the planned items are the same
everywhere. A directory that is not safe to load (custom code, a FIFO among its files,
shards named outside it) or whose name is taken is a usage error naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

__all__ = ["check_recipes", "register_model_dirs"]


def check_recipes(recipes: Sequence[str]) -> None:
    """``--export-quantize``: every recipe is one ``exportlm.quant.quantize`` takes."""
    if not recipes:
        return
    from exportlm.errors import ExportLMError
    from exportlm.quant import QuantRecipe

    for recipe in recipes:
        try:
            QuantRecipe.parse(recipe)
        except (ExportLMError, ValueError, TypeError) as err:
            raise pytest.UsageError(f"--export-quantize {recipe}: {err}") from err


def register_model_dirs(paths: Sequence[Path]) -> list[str]:
    """Register each directory; the family names, in order."""
    if not paths:
        return []
    from exportlm.errors import ExportLMError
    from exportlm.models.directory import register_model_directory

    names = []
    for path in paths:
        if not (path / "config.json").is_file():
            raise pytest.UsageError(
                f"--export-model {path}: not a Hugging Face model directory (no config.json); "
                "expected a directory written by save_pretrained"
            )
        try:
            names.append(register_model_directory(path))
        except (ExportLMError, OSError) as err:
            raise pytest.UsageError(f"--export-model {path}: {err}") from err
    return names
