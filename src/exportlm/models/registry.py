"""The toy model registry: the rows of the conformance matrix.

Built-in families are registered by :func:`register_builtin_models`, called from
:func:`ensure_models_registered`, which also loads third-party families from
the ``exportlm.models`` entry-point group. A family is a factory
``(seed: int = 0, **overrides) -> nn.Module`` whose weights depend on ``seed`` only;
registered as a :class:`ModelFamily` (or any factory with an ``expected_failures``
attribute) it also declares the conformance items it is known to fail, with why.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from exportlm._transformers_model import is_transformers_model
from exportlm.models._init import seeded_init_
from exportlm.models.causes import PER_MODEL_CHECKS, FailureCause, checked_causes
from exportlm.models.decoder import SCRIPT_FAILURE_REASON, DecoderModel
from exportlm.models.hf import (
    HF_FAMILIES,
    hf_family_causes,
    hf_family_failures,
    hf_family_since,
    tiny_hf_model,
)
from exportlm.models.moe import IterableMoEModel
from exportlm.registry import Registry, load_entry_point_registry, once

__all__ = [
    "DECODER_SCRIPT_CAUSE",
    "MODELS_GROUP",
    "MODEL_REGISTRY",
    "ModelFactory",
    "ModelFamily",
    "build_model",
    "ensure_models_registered",
    "model_expected_failures",
    "model_failure_causes",
    "model_names",
    "model_since",
    "family_tolerance_scale",
    "model_tolerance_scale",
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


def _checked_failures(owner: str, declared: object) -> dict[str, str]:
    """``declared`` as ``{pattern: reason}``; anything else is a ``TypeError`` naming ``owner``."""
    if not isinstance(declared, Mapping) or not all(
        isinstance(k, str) and k and isinstance(v, str) and v.strip() for k, v in declared.items()
    ):
        raise TypeError(
            f"{owner}: expected_failures must map non-empty check id or item id patterns to "
            f"non-empty reasons, got {declared!r}"
        )
    return dict(declared)


@dataclass(frozen=True)
class ModelFamily:
    """A toy model family as registered: its factory and the items it is known to fail.

    Calling it calls the factory. Point an ``exportlm.models`` entry point at one
    to declare a family's expected failures in its own package.

    Attributes:
        factory: builds the model: ``(seed: int = 0, **overrides) -> nn.Module``.
        expected_failures: ``{pattern: reason}`` over this family's conformance
            items only, in the syntax of ``TargetInfo.expected_failures``: a bare
            check id (every item of that check), or a pattern over the item id where
            ``*`` and ``?`` are the wildcards (``"roundtrip_logits[onnx-*]"``). For
            failures of one target's own; a failure of a way of capturing the
            model belongs in ``causes``.
        causes: :class:`~exportlm.models.causes.FailureCause` records: why the
            forward fails some captures; every target whose ``TargetInfo.capture``
            is one of them gets the family's items as expected failures.
        since: the conformance catalogue version that added the family (built-ins);
            ``None`` for a family outside the catalogue (a plugin's: always planned).
    """

    factory: ModelFactory
    expected_failures: Mapping[str, str] = field(default_factory=dict)
    causes: tuple[FailureCause, ...] = ()
    since: int | None = None

    def __post_init__(self) -> None:
        owner = f"model family {self.factory!r}"
        checked = _checked_failures(owner, self.expected_failures)
        object.__setattr__(self, "expected_failures", types.MappingProxyType(checked))
        object.__setattr__(self, "causes", checked_causes(owner, self.causes))

    def __call__(self, seed: int = 0, **overrides: Any) -> nn.Module:
        return self.factory(seed, **overrides)

    def __hash__(self) -> int:
        failures = tuple(sorted(self.expected_failures.items()))
        return hash((self.factory, failures, self.causes, self.since))


#: The per-model target checks (``check[target-model-device]``) a declaration covers.
_PER_MODEL_CHECKS = PER_MODEL_CHECKS


def _declared(name: str, failures: Mapping[str, str | None]) -> dict[str, str]:
    """``{target column: reason}`` as item patterns of family ``name`` on every device.

    The family's name is part of each pattern, so a rule is right even where it is
    applied to every item, not only to the family's own.
    """
    return {
        f"{check}[{column}-{name}-*]": reason
        for column, reason in failures.items()
        if reason is not None
        for check in _PER_MODEL_CHECKS
    }


#: Target checks that are not run per model: the conformance suite exports the
#: ``decoder`` family for them, so that family's failures extend to their items.
_MODEL_FREE_CHECKS = ("artifact_contract", "deterministic", "cache_wrapper", "trust")


#: Why every family built on :class:`DecoderModel` fails scripting (``None``: it scripts).
DECODER_SCRIPT_CAUSE: FailureCause | None = (
    None
    if SCRIPT_FAILURE_REASON is None
    else FailureCause(
        "a variable-length KV-cache tuple TorchScript cannot type",
        frozenset({"torchscript-script"}),
        SCRIPT_FAILURE_REASON,
    )
)


def _plain(name: str, factory: ModelFactory) -> ModelFamily:
    # DECODER_SCRIPT_CAUSE is None on a torch that scripts DecoderModel: nothing declared then.
    cause = DECODER_SCRIPT_CAUSE
    if cause is not None and name == "decoder":
        cause = dataclasses.replace(cause, shared_checks=_MODEL_FREE_CHECKS)
    return ModelFamily(factory, causes=() if cause is None else (cause,), since=1)


def _hf(family: str) -> ModelFamily:
    causes = hf_family_causes(family)
    if family == "llama":
        # The generated-structure checks build transformers models (Llama, Mixtral,
        # Qwen3-MoE), so transformers' TorchScript failure covers their items too.
        script = dataclasses.replace(causes[0], shared_checks=("roundtrip_generated",))
        causes = (script, *causes[1:])
    declared = _declared(family, hf_family_failures(family))
    return ModelFamily(_HFFactory(family), declared, causes, hf_family_since(family))


_BUILTINS: dict[str, ModelFamily] = {
    "decoder": _plain("decoder", _PlainFactory(DecoderModel)),
    "decoder_tied": _plain(
        "decoder_tied", _PlainFactory(DecoderModel, (("tie_embeddings", True),))
    ),
    "iterable_moe": _plain("iterable_moe", _PlainFactory(IterableMoEModel)),
    **{family: _hf(family) for family in HF_FAMILIES},
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


def model_expected_failures(name: str) -> dict[str, str]:
    """``{pattern: reason}`` family ``name`` declares (its factory's ``expected_failures``).

    Empty for a family that declares none. Raises
    :class:`~exportlm.errors.UnknownNameError` for an unknown name and ``TypeError``
    for a declaration that is not a mapping of non-empty strings.
    """
    ensure_models_registered()
    declared = getattr(MODEL_REGISTRY.get(name), "expected_failures", None)
    return {} if declared is None else _checked_failures(f"model family {name!r}", declared)


def model_failure_causes(name: str) -> tuple[FailureCause, ...]:
    """The :class:`~exportlm.models.causes.FailureCause` records family ``name`` declares.

    Empty for a family that declares none (a plain factory); ``TypeError`` for a
    declaration that is not a collection of ``FailureCause``.
    """
    ensure_models_registered()
    declared = getattr(MODEL_REGISTRY.get(name), "causes", None)
    return () if declared is None else checked_causes(f"model family {name!r}", declared)


def model_since(name: str) -> int | None:
    """The catalogue version that added family ``name`` (``None``: not in the catalogue)."""
    ensure_models_registered()
    since = getattr(MODEL_REGISTRY.get(name), "since", None)
    return since if isinstance(since, int) and not isinstance(since, bool) else None


def model_tolerance_scale(name: str) -> float:
    """How much family ``name`` widens the targets' ``atol`` / ``rtol`` (1.0 unless it declares
    a ``tolerance_scale``, as a model directory does; an unknown name is 1.0)."""
    ensure_models_registered()
    if name not in MODEL_REGISTRY:
        return 1.0
    return family_tolerance_scale(MODEL_REGISTRY.get(name))


def family_tolerance_scale(factory: Any) -> float:
    """:func:`model_tolerance_scale` of a family's factory (from any registry)."""
    scale = getattr(factory, "tolerance_scale", 1.0)
    ok = isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale)
    return max(1.0, float(scale)) if ok else 1.0


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
    if is_transformers_model(model):
        traits.add("hf")
    if any(name.rsplit(".", 1)[-1] == "experts" for name, _ in model.named_modules()):
        traits.add("moe")
    all_names = sum(1 for _ in model.named_parameters(remove_duplicate=False))
    if all_names > sum(1 for _ in model.named_parameters()):
        traits.add("tied")
    return frozenset(traits)
