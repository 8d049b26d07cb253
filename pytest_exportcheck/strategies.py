"""Public Hypothesis strategies for export tests: model structures, toy configs, class trees.

Use them in your own tests of an export target or a module exporter::

    from hypothesis import given
    from pytest_exportcheck.strategies import decoder_configs, model_settings

    @model_settings(max_examples=3)
    @given(decoder_configs())
    def test_my_target_roundtrips(config):
        ...

:func:`model_specs` draws decoder *structures* (:class:`exportlm.models.ModelSpec`:
layers, hidden size, GQA / MQA heads, tied or untied ``lm_head``, dense or MoE,
vocabularies that are not multiples of 64) that
:func:`exportlm.models.build_from_spec` turns into seeded transformers models,
and :func:`input_shapes` draws ``(batch, seq)`` other than the traced ``(2, 8)``.

Anything that builds or exports a model must run under :func:`model_settings`
(``deadline=None``): Hypothesis's default 200 ms deadline fails every export.
Explicit values apply on top of the active profile, so ``--hypothesis-profile``
and ``--hypothesis-seed`` keep working.
"""

from __future__ import annotations

import copy
import keyword
import math
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

if TYPE_CHECKING:
    from exportlm.models import DecoderConfig, ModelSpec

__all__ = [
    "GENERATED_MODULE",
    "TRACED_SHAPE",
    "class_names",
    "decoder_configs",
    "input_shapes",
    "model_specs",
    "model_settings",
    "module_class_trees",
    "reclass",
]

#: ``__module__`` of every class :func:`module_class_trees` creates.
GENERATED_MODULE = "pytest_exportcheck.generated"

#: ``(batch, seq)`` the built-in targets trace with; :func:`input_shapes` avoids it by default.
TRACED_SHAPE = (2, 8)

M = TypeVar("M")

_PREFIXES = ("", "My", "Fast", "Custom", "_", "Hf", "Fused", "Quant")
_SUFFIXES = ("", "V2", "MoE", "Fused", "_", "Impl", "Base", "Linear")


def model_settings(max_examples: int = 5, **overrides: Any) -> settings:
    """Settings for tests and checks that build or export models.

    ``deadline=None``, few examples, the ``too_slow`` / ``data_too_large``
    health checks off. Values not given here come from the active profile at
    call time, so call it where the test is defined (after pytest configured
    Hypothesis), not at import time of a plugin.
    """
    options: dict[str, Any] = {
        "deadline": None,
        "max_examples": max_examples,
        "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    }
    options.update(overrides)
    return settings(**options)


def _identifiers() -> st.SearchStrategy[str]:
    return st.from_regex(r"[A-Z][A-Za-z0-9]{0,11}", fullmatch=True)


def class_names(
    contains: Sequence[str] = (), *, avoid: Collection[str] = ()
) -> st.SearchStrategy[str]:
    """Valid class names; with ``contains``, also names embedding one of those strings.

    An embedding name is ``prefix + key + suffix`` with a non-empty prefix or
    suffix (``MyQuantLinear``, ``QuantLinearMoE``), so it contains the key as a
    substring without being equal to it: exactly what a substring dispatcher
    mistakes for a match. Names in ``avoid`` (and every name in ``contains``)
    are never produced.
    """
    excluded = set(avoid) | set(contains)
    choices: list[st.SearchStrategy[str]] = [_identifiers()]
    if contains:
        choices.append(
            st.builds(
                lambda p, k, s: p + k + s,
                st.sampled_from(_PREFIXES),
                st.sampled_from(list(contains)),
                st.sampled_from(_SUFFIXES),
            )
        )
    return st.one_of(*choices).filter(
        lambda name: name not in excluded and name.isidentifier() and not keyword.iskeyword(name)
    )


def _make_class(name: str, bases: tuple[type, ...]) -> type:
    return type(name, bases, {"__module__": GENERATED_MODULE, "__qualname__": name})


@st.composite
def _class_tree(
    draw: st.DrawFn,
    base_classes: Sequence[type],
    contains: Sequence[str],
    avoid: Collection[str],
    max_depth: int,
) -> type:
    names = class_names(contains, avoid=avoid)
    cls = draw(st.sampled_from(list(base_classes)))
    for _ in range(draw(st.integers(1, max_depth))):
        bases: tuple[type, ...] = (cls,)
        if draw(st.booleans()):
            # A plain mixin first in the bases: the MRO is no longer a single chain.
            bases = (_make_class(draw(names), (object,)), cls)
        cls = _make_class(draw(names), bases)
    return cls


def module_class_trees(
    base_classes: Sequence[type] | None = None,
    *,
    contains: Sequence[str] = (),
    avoid: Collection[str] = (),
    max_depth: int = 3,
) -> st.SearchStrategy[type]:
    """Freshly created subclasses of one of ``base_classes`` (default ``nn.Module``).

    Each example is a chain of 1..``max_depth`` new classes with generated names
    (see :func:`class_names`; ``contains`` adds names embedding those keys,
    ``avoid`` excludes names), some with a plain mixin placed before the parent
    so the MRO branches. The classes add no attributes, so an existing instance
    can be moved onto one with :func:`reclass`.
    """
    if base_classes is None:
        from torch import nn

        base_classes = (nn.Module,)
    if not base_classes:
        raise ValueError("module_class_trees needs at least one base class")
    if max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    return _class_tree(tuple(base_classes), tuple(contains), frozenset(avoid), max_depth)


def reclass(instance: M, cls: type) -> M:
    """A shallow copy of ``instance`` whose class is ``cls`` (a subclass of its class).

    Parameters and buffers are shared with ``instance``; nothing is mutated.
    """
    if not isinstance(cls, type) or not issubclass(cls, type(instance)):
        raise TypeError(
            f"reclass needs a subclass of {type(instance).__name__}, got {cls!r}; "
            "draw it from module_class_trees([type(instance)])"
        )
    clone = copy.copy(instance)
    clone.__class__ = cls
    return clone


@st.composite
def _decoder_configs(draw: st.DrawFn, multiple_of: int, fixed: dict[str, Any]) -> DecoderConfig:
    from exportlm.models import DecoderConfig

    if multiple_of > 1:
        unit = math.lcm(8, multiple_of)
        hidden = draw(st.sampled_from([unit, 2 * unit]))
        intermediate = draw(st.sampled_from([unit, 2 * unit]))
    else:
        hidden = draw(st.sampled_from([8, 16, 32]))
        intermediate = draw(st.sampled_from([8, 16, 32, 64]))
    heads = draw(st.sampled_from([h for h in (1, 2, 4) if hidden % h == 0]))
    values: dict[str, Any] = {
        "vocab_size": draw(st.integers(8, 64)),
        "hidden_size": hidden,
        "num_layers": draw(st.integers(1, 2)),
        "num_heads": heads,
        "intermediate_size": intermediate,
        "max_position_embeddings": draw(st.sampled_from([16, 32, 64])),
        "tie_embeddings": draw(st.booleans()),
    }
    values.update(fixed)
    return DecoderConfig(**values)


def decoder_configs(multiple_of: int = 1, **fixed: Any) -> st.SearchStrategy[DecoderConfig]:
    """Small valid :class:`~exportlm.models.DecoderConfig` values, tied and untied.

    Hidden sizes 8-32 (``multiple_of=128``: 128 or 256, so NVFP4 blocks of 16 and
    INT4 AWQ groups of 128 fit), 1-4 heads dividing it, 1-2 layers, vocab 8-64,
    ``tie_embeddings`` either way. ``fixed`` pins fields, e.g.
    ``decoder_configs(tie_embeddings=True)``.
    """
    if multiple_of < 1:
        raise ValueError(f"multiple_of must be >= 1, got {multiple_of}")
    return _decoder_configs(multiple_of, dict(fixed))


#: Hidden sizes of :func:`model_specs` (all multiples of 16: NVFP4 blocks fit). 192 is a
#: real model's shape scaled down (SmolLM2-135M: 576 = 4.5 x 128, 9 heads of 64, 3 KV
#: heads): not a multiple of 128, so INT4 groups of 128 do not fit, with 3 heads of 64.
_SPEC_HIDDEN = (16, 32, 48, 64, 192)
#: Intermediate (MoE: per-expert) sizes of :func:`model_specs`; 320 = 2.5 x 128.
_SPEC_INTERMEDIATE = (16, 32, 64, 128, 320)
#: Attention heads drawn: 3 gives GQA ratios of 3 (3 heads over 1 KV head), as real models have.
_SPEC_HEADS = (1, 2, 3, 4, 8)
_SPEC_MIN_HEAD_DIM = 4


def _not_multiple_of_64(vocab: int) -> bool:
    return vocab % 64 != 0


@st.composite
def _model_specs(
    draw: st.DrawFn,
    families: tuple[str, ...],
    max_layers: int,
    vocab: tuple[int, int],
    fixed: dict[str, Any],
) -> ModelSpec:
    from exportlm.models import SPEC_FAMILIES, ModelSpec

    family = draw(st.sampled_from(families))
    hidden = draw(st.sampled_from(_SPEC_HIDDEN))
    heads = draw(
        st.sampled_from(
            [
                h
                for h in _SPEC_HEADS
                if hidden % h == 0 and (hidden // h) % 2 == 0 and hidden // h >= _SPEC_MIN_HEAD_DIM
            ]
        )
    )
    values: dict[str, Any] = {
        "family": family,
        # Shrinks towards the low end: 97, a prime, is the smallest vocabulary drawn.
        "vocab_size": draw(st.integers(*vocab).filter(_not_multiple_of_64)),
        "hidden_size": hidden,
        "num_layers": draw(st.integers(1, max_layers)),
        "num_heads": heads,
        # 1 first: multi-query attention is what a failure shrinks to.
        "num_kv_heads": draw(st.sampled_from([k for k in range(1, heads + 1) if heads % k == 0])),
        "intermediate_size": draw(st.sampled_from(_SPEC_INTERMEDIATE)),
        "tie_embeddings": draw(st.booleans()),
        "num_experts": 0,
        "num_experts_per_tok": 0,
    }
    if SPEC_FAMILIES[family]:
        experts = draw(st.integers(2, 4))
        values["num_experts"] = experts
        values["num_experts_per_tok"] = draw(st.integers(1, min(2, experts)))
    values.update(fixed)
    return ModelSpec(**values)


def model_specs(
    *,
    families: Sequence[str] | None = None,
    moe: bool | None = None,
    max_layers: int = 4,
    vocab: tuple[int, int] = (97, 400),
    **fixed: Any,
) -> st.SearchStrategy[ModelSpec]:
    """Small decoder structures (:class:`exportlm.models.ModelSpec`), frozen and JSON-serialisable.

    Llama (dense), Mixtral or Qwen3-MoE (2-4 experts, top-1 or top-2); 1 to
    ``max_layers`` layers; hidden 16-64 or 192 with 1-8 heads (even ``head_dim`` >= 4;
    3 heads of 64 at 192) and key/value heads dividing them, down to 1 (GQA ratios
    up to 8, 3 among them, and MQA); intermediate 16-128 or 320 (192 and 320 are not
    multiples of 128: the shapes of real models that INT4 groups of 128 refuse); tied or untied ``lm_head``; a vocabulary in ``vocab`` that is never
    a multiple of 64 (so never a power of two either). Failures shrink to
    ``llama``, 1 layer, hidden 16, one KV head, vocabulary 97. ``moe=True`` /
    ``False`` restricts the families; ``fixed`` pins fields, e.g.
    ``model_specs(tie_embeddings=True)``. Build one with
    :func:`exportlm.models.build_from_spec` (``spec.to_dict()`` is its JSON form,
    which ``exportlm export --model FILE.json`` reads).
    """
    from exportlm.models import SPEC_FAMILIES

    chosen = tuple(families) if families is not None else tuple(SPEC_FAMILIES)
    unknown = [f for f in chosen if f not in SPEC_FAMILIES]
    if unknown or not chosen:
        raise ValueError(f"families must be among {sorted(SPEC_FAMILIES)}, got {list(chosen)}")
    if moe is not None:
        chosen = tuple(f for f in chosen if SPEC_FAMILIES[f] is moe)
        if not chosen:
            raise ValueError(f"no family among {families} has moe={moe}")
    if max_layers < 1:
        raise ValueError(f"max_layers must be >= 1, got {max_layers}")
    low, high = vocab
    if not 1 <= low <= high or (low == high and low % 64 == 0):
        raise ValueError(
            f"vocab must be a range (low, high), 1 <= low <= high, holding a size that is "
            f"not a multiple of 64; got {vocab}"
        )
    return _model_specs(chosen, max_layers, (low, high), dict(fixed))


def input_shapes(
    max_batch: int = 4, max_seq: int = 16, *, exclude: Collection[tuple[int, int]] = (TRACED_SHAPE,)
) -> st.SearchStrategy[tuple[int, int]]:
    """``(batch, seq)`` with ``1 <= batch <= max_batch``, ``1 <= seq <= max_seq``, not in ``exclude``.

    By default the traced shape ``(2, 8)`` is excluded, so a drawn shape always
    exercises a target's dynamic batch and sequence dimensions.
    """
    if max_batch < 1 or max_seq < 1:
        raise ValueError(f"max_batch and max_seq must be >= 1, got {max_batch}, {max_seq}")
    excluded = frozenset(tuple(s) for s in exclude)
    return st.tuples(st.integers(1, max_batch), st.integers(1, max_seq)).filter(
        lambda shape: shape not in excluded
    )
