"""``QUANT_FORMATS``: the registry of format specs, and the lookups derived from it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping

from exportlm.errors import RegistryConflictError, UnknownNameError
from exportlm.quant._tensor import FormatId, format_name, install_format_lookup
from exportlm.quant.formats._fp8 import FP8
from exportlm.quant.formats._fp8_block import FP8_BLOCK, FP8_GROUP
from exportlm.quant.formats._fp8_dynamic import FP8_DYNAMIC
from exportlm.quant.formats._int4 import INT4
from exportlm.quant.formats._int8 import INT8
from exportlm.quant.formats._int8_sq import INT8_SQ, INT8_TENSOR, W8A8
from exportlm.quant.formats._mx import MXFP4, MXFP8
from exportlm.quant.formats._nvfp4 import NVFP4
from exportlm.quant.formats._parts import LeafRole
from exportlm.quant.formats._spec import FormatSpec
from exportlm.quant.formats._w4a8 import W4A8
from exportlm.quant.formats._w4afp8 import W4AFP8
from exportlm.registry import Registry

__all__ = [
    "BUILTIN_FORMATS",
    "QUANT_FORMATS",
    "activation_leaf_names",
    "format_for_kv_cache_algo",
    "format_for_quant_algo",
    "formats",
    "get_format",
    "install_recipe_claims",
    "register_format",
    "scale_leaf_names",
]


def _validate(name: str, obj: object) -> FormatSpec:
    if not isinstance(obj, FormatSpec):
        raise TypeError(
            f"quantization format {name!r} must be a FormatSpec, got {type(obj).__name__}"
        )
    if obj.name != name:
        raise ValueError(f"FormatSpec {obj.name!r} registered under another name, {name!r}")
    return obj


#: Format specs by name (``"fp8"``, ``"nvfp4"``, ``"int4"``, ``"int8"`` + registered ones).
QUANT_FORMATS: Registry[FormatSpec] = Registry("quantization format", _validate)
#: The built-in specs, registered below in this order.
BUILTIN_FORMATS: tuple[FormatSpec, ...] = (
    FP8,
    NVFP4,
    INT4,
    INT8,
    INT8_SQ,
    INT8_TENSOR,
    W8A8,
    FP8_DYNAMIC,
    MXFP4,
    MXFP8,
    FP8_GROUP,
    FP8_BLOCK,
    W4A8,
    W4AFP8,
)
_LOCK = threading.Lock()
#: ``{recipe name: owner}`` of the records in the recipe registry (installed by it), which a
#: format's deprecated ``recipe`` field may not claim.
_RECIPE_CLAIMS: list[Callable[[], Mapping[str, str]]] = []


def install_recipe_claims(claims: Callable[[], Mapping[str, str]]) -> None:
    """Let :func:`register_format` refuse a format whose own recipe takes a registered name.

    Installed by :mod:`exportlm.quant._recipe_registry`, which sits above this package.
    """
    _RECIPE_CLAIMS[:] = [claims]


def formats() -> list[FormatSpec]:
    """Every registered spec, sorted by name."""
    return [entry.obj for entry in QUANT_FORMATS.entries()]


def get_format(fmt: FormatId) -> FormatSpec:
    """The spec of ``fmt`` (a :class:`~exportlm.quant.QuantFormat` member or a name).

    Raises :class:`~exportlm.errors.UnknownNameError` (a ``ValueError``) listing
    the registered formats.
    """
    return QUANT_FORMATS.get(format_name(fmt))


def register_format(spec: FormatSpec, *, builtin: bool = False) -> FormatSpec:
    """Add a quantization format; returns ``spec``.

    After this, ``TensorQuantizer(spec.name)``, :func:`~exportlm.quant.quantize_tensor`,
    :func:`~exportlm.quant.dequantize`, the checkpoint writer and loader and the built-in
    module exporters all handle the format; a recipe on it
    (:func:`~exportlm.quant.register_recipe`) makes ``quantize(model, recipe.name)`` use it.
    A spec's deprecated ``recipe`` field (and ``spec.kv_cache.recipe``) is such a recipe too.

    Registering the very same spec again is a no-op. Raises
    :class:`~exportlm.errors.RegistryConflictError` when another spec already owns
    the format name, its recipe or KV-cache recipe name, or its ModelOpt
    ``quant_algo`` / ``kv_cache_quant_algo``; nothing is registered then.
    """
    spec = _validate(spec.name if isinstance(spec, FormatSpec) else "?", spec)
    with _LOCK:
        if spec.name in QUANT_FORMATS:  # the same spec: a no-op; another one: a conflict
            return QUANT_FORMATS.register(spec.name, spec, builtin=builtin)
        owners = {claim: f"format {o.name!r}" for o in formats() for claim in _claims(o)}
        for claims in _RECIPE_CLAIMS:
            owners.update((("quantization recipe", n), who) for n, who in claims().items())
        for kind, claimed in _claims(spec):
            owner = owners.get((kind, claimed))
            if owner is not None:
                raise RegistryConflictError(kind, claimed, owner, f"format {spec.name!r}")
        return QUANT_FORMATS.register(spec.name, spec, builtin=builtin)


def _claims(spec: FormatSpec) -> Iterator[tuple[str, str]]:
    """``(kind, name)`` of every name besides its own that ``spec`` claims."""
    if spec.recipe is not None:
        yield "quantization recipe", spec.recipe.name
    if spec.kv_cache is not None:
        yield "quantization recipe", spec.kv_cache.recipe
        yield "ModelOpt kv_cache_quant_algo", spec.kv_cache.quant_algo
    if spec.modelopt is not None:
        yield "ModelOpt quant_algo", spec.modelopt.quant_algo


def format_for_quant_algo(quant_algo: str) -> FormatSpec:
    """The spec whose ModelOpt ``quant_algo`` is ``quant_algo`` (``"W4A16_AWQ"`` -> int4).

    Raises :class:`~exportlm.errors.UnknownNameError` listing the known ones.
    """
    by_algo = {s.modelopt.quant_algo: s for s in formats() if s.modelopt is not None}
    if quant_algo in by_algo:
        return by_algo[quant_algo]
    # vLLM upper-cases quant_algo before it dispatches (ModelOpt writes "fp8_pb_wo" lowercase)
    folded = [s for algo, s in by_algo.items() if algo.upper() == quant_algo.upper()]
    if len(folded) != 1:
        raise UnknownNameError("ModelOpt quant_algo", quant_algo, list(by_algo))
    return folded[0]


def format_for_kv_cache_algo(kv_cache_quant_algo: str) -> FormatSpec:
    """The spec whose KV-cache recipe writes ``kv_cache_quant_algo`` (``"FP8"`` -> fp8).

    Raises :class:`~exportlm.errors.UnknownNameError` listing the known ones.
    """
    by_algo = {s.kv_cache.quant_algo: s for s in formats() if s.kv_cache is not None}
    if kv_cache_quant_algo not in by_algo:
        raise UnknownNameError("ModelOpt kv_cache_quant_algo", kv_cache_quant_algo, list(by_algo))
    return by_algo[kv_cache_quant_algo]


_ROLE_ORDER: tuple[LeafRole, ...] = ("weight", "activation", "kv_cache")


def _leaf_names(roles: tuple[LeafRole, ...]) -> tuple[str, ...]:
    names: dict[str, None] = {}
    for role in roles:
        for spec in formats():
            for leaf in spec.leaves:
                if leaf.role == role and leaf.source != "data":
                    names.setdefault(leaf.name, None)
    return tuple(names)


def scale_leaf_names() -> tuple[str, ...]:
    """Every checkpoint leaf that is a scale, over all registered formats.

    Weight scales, then activation scales, then KV-cache scales; for the built-ins
    ``("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale",
    "k_scale", "v_scale")``. A scale is never zero, NaN or infinite.
    """
    return _leaf_names(_ROLE_ORDER)


def activation_leaf_names() -> tuple[str, ...]:
    """The scale leaves that come from calibration activations (not from the weights).

    For the built-ins ``("input_scale", "pre_quant_scale", "k_scale", "v_scale")``.
    """
    return _leaf_names(_ROLE_ORDER[1:])


for _spec in BUILTIN_FORMATS:
    register_format(_spec, builtin=True)
# QuantFormat.maxbound and QuantizedTensor.dequantize (below the specs) read specs here.
install_format_lookup(get_format)
