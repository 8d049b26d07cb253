"""The toy model registry: the rows of the conformance matrix.

Built-in families are registered by :func:`register_builtin_models`, called from
:func:`ensure_models_registered`, which also loads third-party families from
the ``exportlm.models`` entry-point group. A family is a factory
``(seed: int = 0, **overrides) -> nn.Module`` whose weights depend on ``seed`` only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import transformers
from torch import nn

from exportlm.models._init import seeded_init_
from exportlm.models.decoder import DecoderModel
from exportlm.models.hf import HF_FAMILIES, tiny_hf_model
from exportlm.models.moe import IterableMoEModel
from exportlm.registry import Registry, load_entry_point_registry, once

__all__ = [
    "MODELS_GROUP",
    "MODEL_REGISTRY",
    "ModelFactory",
    "build_model",
    "ensure_models_registered",
    "model_names",
    "model_traits",
    "register_builtin_models",
]

#: Entry-point group through which third parties add toy model families.
MODELS_GROUP = "exportlm.models"


class ModelFactory(Protocol):
    """Builds a toy model: same ``seed`` and ``overrides`` give the same weights, bytewise."""

    def __call__(self, seed: int = 0, **overrides: Any) -> nn.Module: ...


def _validate_factory(name: str, obj: Any) -> ModelFactory:
    if not callable(obj):
        raise TypeError(
            f"model family {name!r} must be a callable (seed: int = 0, **overrides) -> nn.Module, "
            f"got {type(obj).__name__}"
        )
    return obj  # type: ignore[no-any-return]


#: Toy model families by name.
MODEL_REGISTRY: Registry[ModelFactory] = Registry("model family", _validate_factory)


@dataclass(frozen=True)
class _PlainFactory:
    """A project model class with seeded weights (frozen: registering it twice is a no-op)."""

    model_class: Callable[..., nn.Module]
    defaults: tuple[tuple[str, Any], ...] = ()

    def __call__(self, seed: int = 0, **overrides: Any) -> nn.Module:
        # torch's default init draws from the global RNG; keep the caller's stream intact.
        with torch.random.fork_rng(devices=[]):
            model = self.model_class(**{**dict(self.defaults), **overrides})
        return seeded_init_(model, seed).eval()


@dataclass(frozen=True)
class _HFFactory:
    """:func:`tiny_hf_model` of one family."""

    family: str

    def __call__(self, seed: int = 0, **overrides: Any) -> nn.Module:
        model: nn.Module = tiny_hf_model(self.family, seed, **overrides)
        return model


_BUILTINS: dict[str, ModelFactory] = {
    "decoder": _PlainFactory(DecoderModel),
    "decoder_tied": _PlainFactory(DecoderModel, (("tie_embeddings", True),)),
    "iterable_moe": _PlainFactory(IterableMoEModel),
    **{family: _HFFactory(family) for family in HF_FAMILIES},
}


def register_builtin_models(registry: Registry[ModelFactory]) -> None:
    """Register the built-in families in ``registry`` (idempotent: same objects each time)."""
    for name, factory in _BUILTINS.items():
        registry.register(name, factory, builtin=True)


@once
def ensure_models_registered() -> None:
    """Register the built-ins in :data:`MODEL_REGISTRY` and load entry-point families.

    Idempotent and thread-safe. A plugin that fails to load is recorded in
    ``MODEL_REGISTRY.failed()`` and warned about; it never hides the others.
    """
    register_builtin_models(MODEL_REGISTRY)
    load_entry_point_registry(MODELS_GROUP, MODEL_REGISTRY, raise_errors=False)


def model_names() -> list[str]:
    """Every registered family name, sorted."""
    ensure_models_registered()
    return MODEL_REGISTRY.names()


def build_model(name: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """Build family ``name`` with ``seed`` and config ``overrides``.

    Raises :class:`~exportlm.errors.UnknownNameError` (a ``ValueError``) listing
    the families for an unknown name, and
    :class:`~exportlm.errors.UnknownOptionError` (a ``TypeError``) for an
    override the family does not have.
    """
    ensure_models_registered()
    return MODEL_REGISTRY.get(name)(seed, **overrides)


def model_traits(model: nn.Module) -> frozenset[str]:
    """What kind of model this is, for capability decisions:

    - ``"hf"``: a transformers ``PreTrainedModel``;
    - ``"moe"``: some submodule is named ``experts`` (iterable or fused);
    - ``"tied"``: some parameter is reachable under two names.
    """
    traits: set[str] = set()
    if isinstance(model, transformers.PreTrainedModel):
        traits.add("hf")
    if any(name.rsplit(".", 1)[-1] == "experts" for name, _ in model.named_modules()):
        traits.add("moe")
    all_names = sum(1 for _ in model.named_parameters(remove_duplicate=False))
    if all_names > sum(1 for _ in model.named_parameters()):
        traits.add("tied")
    return frozenset(traits)
