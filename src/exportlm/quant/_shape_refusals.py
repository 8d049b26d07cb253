"""Weights whose shape a recipe's format cannot take, refused naming every module refused alike.

A group size that does not divide a linear's input features (``int4_awq`` groups of 128 on
SmolLM2's 576) refuses that projection in every layer, and every other projection of that
width. The refusal names them all, so the exclusion it suggests is the last one needed: a
pattern per projection for every layer (``*.self_attn.q_proj``), merged where every
quantized module of a block is refused (``*.self_attn.*``), or the names themselves where no
pattern covers exactly them; and the ``group_size`` options it names fit every weight the
recipe quantizes, not only the first refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from exportlm.errors import UnsupportedFormatError
from exportlm.quant._experts import experts_base
from exportlm.quant._recipe import Algorithm
from exportlm.quant.formats import CHECKPOINT_LAYOUTS, FormatSpec, get_format

__all__ = ["covering_patterns", "every_layer", "refuse_shapes"]


def every_layer(name: str) -> str:
    """A pattern matching module ``name`` in every decoder layer (``*.mlp.experts``)."""
    parts = name.split(".")
    return "*." + ".".join(parts[-2:]) if len(parts) > 2 else name


def _any(names: Sequence[str], pattern: str) -> bool:
    return any(fnmatchcase(name, pattern) for name in names)


def covering_patterns(refused: Sequence[str], kept: Sequence[str]) -> list[str]:
    """fnmatch patterns (as ``exclude`` matches them) that match every name of ``refused`` and
    none of ``kept``: one per projection for every layer, a block's merged where none of
    ``kept`` is in it (``*.self_attn.*``); the names themselves where no such pattern exists."""
    patterns = list(dict.fromkeys(every_layer(name) for name in refused))
    if any(_any(kept, pattern) for pattern in patterns):
        return list(dict.fromkeys(refused))
    merged: list[str] = []
    for pattern in patterns:
        block = pattern.rpartition(".")[0] + ".*"
        if pattern.startswith("*.") and block != "*.*" and not _any(kept, block):
            pattern = block
        merged += [pattern] if pattern not in merged else []
    return merged


@dataclass(frozen=True)
class _Refused:
    """A conversion the shape check refuses: the weight and what it lacks (``need``); ``need``
    ``None``: experts without a gate, or with a post-expert norm."""

    conversion: Any
    what: str = ""
    rows: int = 0
    cols: int = 0
    need: str | None = None

    @property
    def reason(self) -> tuple[Algorithm, bool]:
        return self.conversion.algo, self.need is None


def _refused(conversion: Any) -> _Refused | None:
    algo, module, kind = conversion.algo, conversion.module, conversion.kind
    if algo is None:
        return None
    spec = get_format(algo.weight)
    for what, rows, cols in _in_dims(module, kind):
        need = spec.shape_problem(rows, cols, algo.weight_block)
        if need is not None:
            return _Refused(conversion, what, rows, cols, need)
    if not algo.weight_block:
        return None  # unchanged behaviour: the experts check below runs for block recipes only
    if kind == "experts" and (
        not getattr(module, "has_gate", True) or getattr(module, "has_post_expert_norm", False)
    ):
        return _Refused(conversion)
    return None


def refuse_shapes(conversion: Any, conversions: Sequence[Any]) -> None:
    """``conversion``'s weight refused when ``algo``'s format cannot take its shape, naming
    every conversion refused alike (a ``.name``, ``.module``, ``.kind`` and ``.algo`` each).

    For a block recipe whose group size does not divide the input features, the message
    names the ``group_size`` options that fit every weight of the recipe ("group_size=64
    divides 576"), and an exclusion covering every module refused for it.
    """
    first = _refused(conversion)
    if first is None:
        return
    alike = [r for c in conversions if (r := _refused(c)) is not None and r.reason == first.reason]
    names = [r.conversion.name for r in alike]
    kept = [c.name for c in conversions if c.name not in set(names)]
    patterns = covering_patterns(names, kept)
    them = "them" if len(names) > 1 else "it"
    exclude = f"exclude={patterns!r}, " + " ".join(f"--exclude {p!r}" for p in patterns)
    module = conversion.module
    where = f"module {conversion.name!r} ({type(module).__name__})"
    more = f" ({len(names) - 1} more module(s) are refused alike)" if len(names) > 1 else ""
    if first.need is None:
        raise UnsupportedFormatError(
            f"{where}: only gated experts without a post-expert norm can be quantized{more}; "
            f"exclude {them} ({exclude})"
        )
    algo = conversion.algo
    dims = [(r, k) for c in conversions if c.algo == algo for _, r, k in _in_dims(c.module, c.kind)]
    widths = " and ".join(str(w) for w in sorted({r.cols for r in alike}))
    recipe = "{" + ", ".join(f"{p!r}: 'fp8'" for p in patterns) + "}"
    raise UnsupportedFormatError(
        f"{where}: recipe {algo.spelling!r} needs {first.need}, but {first.what} has shape "
        f"{_weight_shape(module, conversion.kind)} ({first.rows} out x {first.cols} in){more}. "
        f"{_fitting_group_sizes(algo, dims, widths)}Exclude {them} ({exclude}) or give "
        f"{them} another recipe ({recipe})."
    )


def _weight_shape(module: Any, kind: str) -> tuple[int, ...]:
    if kind == "experts":  # the first stored expert weight
        return tuple(next(module.parameters()).shape)
    return tuple(module.weight.shape)


def _in_dims(module: Any, kind: str) -> list[tuple[str, int, int]]:
    """(what, rows, input features) of each weight the algorithm quantizes."""
    if kind != "experts":
        rows, cols = module.weight.shape
        return [("weight", rows, cols)]
    base = experts_base(module)
    return [] if base is None else base.weight_dims(module)


def _fitting_group_sizes(algo: Algorithm, dims: Sequence[tuple[int, int]], widths: str) -> str:
    """The sentence naming the ``group_size`` options that fit every ``[rows, cols]`` of
    ``dims`` (the recipe's weights), or ``""``; ``widths``: the refused input features.

    Where the default (ModelOpt) layout cannot hold the size that fits (``fp8_block``: blocks
    of 128 only), the command named is one that works in one step: it names the layout too
    (``--quantize fp8_block:group_size=64 -o format=compressed-tensors``), never an option
    the layout check then refuses.
    """
    spec = get_format(algo.weight)
    fits = [
        size
        for size in sorted(algo.allowed_group_sizes, reverse=True)
        if size != algo.weight_block
        and all(spec.shape_problem(rows, cols, size) is None for rows, cols in dims)
    ]
    if not fits:
        return ""
    sizes = " or ".join(f"group_size={size}" for size in fits)
    spelled, best = f"{algo.name}:group_size={fits[0]}", fits[0]
    if spec.modelopt is None or spec.modelopt_block_problem(best) is None:
        return (
            f"{sizes} divides {widths}: quantize with {spelled} (--quantize {spelled}, or "
            f"quantize(model, {algo.name!r}, group_size={best})). "
        )
    held = f"the ModelOpt layout holds {algo.name} in blocks of "
    held += " or ".join(map(str, spec.modelopt.block_sizes)) + " only"
    layouts = _block_layouts(spec)
    if not layouts:
        return f"{sizes} divides {widths}, but {held} and no other layout holds {algo.name}. "
    where = " or ".join(f"-o format={name}" for name in layouts)
    return (
        f"{sizes} divides {widths}: quantize with {spelled} in a layout that records the block "
        f"({held}; it is the default): --quantize {spelled} {where}, or quantize(model, "
        f"{algo.name!r}, group_size={best}) then export_model(..., format={layouts[0]!r}). "
    )


def _block_layouts(spec: FormatSpec) -> list[str]:
    """The layouts other than ModelOpt's that hold ``spec`` for every model type (they record
    the block size)."""
    return [
        name
        for name, layout in CHECKPOINT_LAYOUTS.items()
        if layout.scheme is not None and not layout.model_types and layout.holds(spec)
    ]
