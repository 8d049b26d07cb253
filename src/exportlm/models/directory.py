"""A local Hugging Face model directory as a model family: the user's own model in the suite.

``pytest --export-targets=all --export-model=PATH`` registers each directory here
(:func:`register_model_directory`), so every per-model check runs on it as a row of the
matrix, beside the toy families. The directory is read by the rules of every directory
exportlm did not write (:func:`exportlm.hfdir.vet_model_directory`: no ``auto_map``, no
``*.py``, no FIFO or device among its files, shards confined to it) before transformers
sees it, and loaded with ``local_files_only=True`` and ``trust_remote_code=False``.

The weights are the directory's (the seed is ignored), loaded in float32 whatever dtype
they were saved in: every built-in target exports and compares float32, and a bf16
model's export to ONNX is refused. Its tolerance is the target's, scaled by
:func:`tolerance_scale` (``docs/checks.md``, "Your own model").
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from torch import nn

from exportlm.errors import UnknownOptionError
from exportlm.hfdir import check_loading_info, transformers_errors, vet_model_directory
from exportlm.source_config import check_source_config

__all__ = ["DirectoryFamily", "directory_family_name", "register_model_directory"]

#: Layers of the deepest toy family (``llama``: 2); rounding grows with depth.
_TOY_LAYERS = 2


class DirectoryFamily:
    """Builds the model saved in ``path`` (float32, eval mode); see the module docstring."""

    expected_failures: dict[str, str] = {}
    causes: tuple[Any, ...] = ()
    since: int | None = None  # not part of the catalogue: never pinned away

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).resolve()
        self.where = f"model directory {self.path}"
        self.config = vet_model_directory(self.path)  # refused before anything loads
        check_source_config(self.path, self.config, self.where)

    def __call__(self, seed: int = 0, **overrides: Any) -> nn.Module:
        del seed  # trained weights: nothing to seed
        if overrides:
            raise UnknownOptionError(f"model directory {self.path}", list(overrides), [])
        import torch
        from transformers import AutoModelForCausalLM

        config = vet_model_directory(self.path)  # again: the directory may have changed since
        check_source_config(self.path, config, self.where)
        with transformers_errors(self.where, "load a causal LM"):
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                self.path,
                local_files_only=True,
                trust_remote_code=False,
                dtype=torch.float32,
                output_loading_info=True,
            )
        model, info = loaded
        check_loading_info(info, self.where, type(model).__name__)
        model.eval()
        return model  # type: ignore[no-any-return]

    @property
    def tolerance_scale(self) -> float:
        """How much the targets' declared ``atol`` / ``rtol`` are widened for this model.

        ``max(1, layers / 2) * max(1, sqrt(hidden / 128))``: float32 rounding of a
        forward grows with its depth (each layer adds the op-order differences of an
        attention and an MLP) and, through the length of the dot products, with the
        square root of the hidden size; the declared tolerances were measured on the toy
        families (2 layers, hidden 128, logits within ~5).
        """
        layers = _positive(self.config, "num_hidden_layers", "n_layers", "num_layers")
        hidden = _positive(self.config, "hidden_size", "d_model", "n_embd")
        return max(1.0, layers / _TOY_LAYERS) * max(1.0, math.sqrt(hidden / 128))


def _positive(config: dict[str, Any], *keys: str) -> float:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return float(value)
    return 1.0


def directory_family_name(path: str | Path) -> str:
    """The family name of a model directory: its folder name in ``[a-z0-9_]`` (``my-model.v2`` ->
    ``my_model_v2``), as it appears in the suite's node ids."""
    name = re.sub(r"[^a-z0-9_]+", "_", Path(path).resolve().name.lower()).strip("_")
    return name or "model_directory"


def register_model_directory(path: str | Path, registry: Any = None) -> str:
    """Register the model directory ``path`` as a family; its name (see :func:`directory_family_name`).

    Registering the same directory again is a no-op. Raises what
    :func:`~exportlm.hfdir.vet_model_directory` raises for a directory that is not safe
    to load, and :class:`~exportlm.errors.RegistryConflictError` when the name is taken.
    """
    from exportlm.models.registry import MODEL_REGISTRY, ensure_models_registered

    ensure_models_registered()
    registry = MODEL_REGISTRY if registry is None else registry
    name = directory_family_name(path)
    family = DirectoryFamily(path)
    if name in registry:
        existing = registry.get(name)
        if isinstance(existing, DirectoryFamily) and existing.path == family.path:
            return name
    registry.register(name, family)
    return name
