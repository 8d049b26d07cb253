"""Recipe options: ``int4_awq:group_size=64`` and ``quantize(model, "int4_awq", group_size=64)``.

A recipe part is spelled ``NAME[:KEY=VALUE[,KEY=VALUE...]]``; the options a recipe takes
are what its :class:`~exportlm.quant.Recipe` record declares:

==============  ==========================================  ===============================
option          recipes                                     values
==============  ==========================================  ===============================
``group_size``  block recipes whose format takes several    one of the recipe's group sizes
                group sizes (``int4_awq``: 32, 64, 128)     (INT4: 32, 64, 128; default 128)
``alpha``       SmoothQuant recipes (``int8_sq``, ``w8a8``)  a number in [0, 1]
``scales``      recipes whose weight scales come from a     ``modelopt`` (default) or
                calibrated amax (``fp8``, ``nvfp4``), AWQ   ``compressed-tensors``
                (``int4_awq``), GPTQ, and row / group
                scales compressed-tensors computes
                otherwise (``int8_wo``, ``w8a8``,
                ``fp8_dynamic``)
``clip``        AWQ recipes (``int4_awq``, ``w4a8_awq``)    ``true`` (default) or ``false``
``actorder``    GPTQ (``int4_gptq``, ``int8_gptq``)         ``weight`` (default) or ``none``
``dampening``   GPTQ (``int4_gptq``, ``int8_gptq``)         a number in [0, 1] (default 0.01)
==============  ==========================================  ===============================

``scales=compressed-tensors`` computes NVFP4's global scale as compressed-tensors does
(``6 * 448 / amax``, the block scales divided by it) and keeps the other calibrated
scales in the dtype of the module's weight (bfloat16 for a bfloat16 model), as
llm-compressor writes them: the checkpoint of that layout is then the calibrated model
exactly. ``export --quantize ... -o format=compressed-tensors`` chooses it. Under it AWQ
folds every scale into the op before its linears, as llm-compressor's mappings do (a norm,
or ``v_proj`` / ``up_proj`` for ``o_proj`` / ``down_proj``: :mod:`exportlm.quant._fold_linear`),
and a linear with no such op gets no scale (round-to-nearest), since compressed-tensors
stores no ``pre_quant_scale``. For GPTQ (``int4_gptq``) it keeps the INT4 group scales
``group_amax / 7`` in the weight's dtype (not compressed-tensors' ``/ 7.5``, which measured
worse under GPTQ; ``docs/checkpoint-format.md``) where the default keeps them in float32
(``int8_gptq``: row scales, ``row_amax / 127.5`` in the weight's dtype against ``/ 127``).
Round-to-nearest row and group scales (INT4, ``int8_wo``, ``w8a8``, ``fp8_dynamic``) are
compressed-tensors' own: ``amax / 7.5``, ``/ 127.5``, ``/ 448`` rounded to the weight's dtype,
the codes rounded from the quotient in that dtype, as llm-compressor computes them; tensor for
tensor its checkpoint of the same weights (``docs/checkpoint-format.md``).

``clip=true`` searches each INT4 group's range after AWQ's smoothing
(:mod:`exportlm.quant._awq_clip`, as AutoAWQ and ModelOpt's ``awq_full`` do);
``clip=false`` leaves the ranges at the groups' amax, as ModelOpt's ``INT4_AWQ_CFG``
(``awq_lite``) does.

No layout exportlm writes for INT4 has a zero point (ModelOpt's ``W4A16_AWQ`` and
compressed-tensors' symmetric ``pack-quantized``), so no recipe takes ``symmetric``.
An unknown option is an :class:`~exportlm.errors.UnknownOptionError` naming the known
ones; a value a recipe cannot take is an :class:`~exportlm.errors.InvalidRecipeError` (a
``ValueError``) naming the values it can.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from exportlm.errors import InvalidRecipeError, UnknownOptionError
from exportlm.quant._gptq import ACTORDERS as GPTQ_ACTORDERS
from exportlm.quant._recipes import Recipe
from exportlm.quant.formats import get_format

__all__ = [
    "SCALE_CONVENTIONS",
    "OptionValue",
    "apply_options",
    "known_options",
    "spell",
    "split_options",
]

#: The values of the ``scales`` option (a ``_`` for the ``-`` is taken too).
SCALE_CONVENTIONS = ("modelopt", "compressed-tensors")

OptionValue = bool | int | float | str
_TRUE, _FALSE = ("true", "yes", "on"), ("false", "no", "off")


def split_options(part: str) -> tuple[str, dict[str, OptionValue]]:
    """``("int4_awq", {"group_size": 64})`` of ``"int4_awq:group_size=64"``."""
    name, sep, rest = part.partition(":")
    options: dict[str, OptionValue] = {}
    if sep:
        for item in rest.split(","):
            key, eq, raw = item.partition("=")
            if not eq or not key.strip() or not raw.strip():
                raise InvalidRecipeError(
                    f"recipe {part!r}: options are KEY=VALUE separated by commas, e.g. "
                    f"'{name.strip()}:group_size=64'; got {item!r}"
                )
            if key.strip() in options:  # which one would win is not the user's to guess
                raise InvalidRecipeError(
                    f"recipe {part!r}: option {key.strip()!r} is given twice; give it once"
                )
            options[key.strip()] = _value(raw.strip())
    return name.strip(), options


def _value(raw: str) -> OptionValue:
    if raw.lower() in _TRUE or raw.lower() in _FALSE:
        return raw.lower() in _TRUE
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            continue
    return raw


def spell(name: str, options: Mapping[str, OptionValue]) -> str:
    """The canonical spelling of a recipe part: ``name:key=value,...`` by key order."""
    if not options:
        return name
    return name + ":" + ",".join(f"{k}={_spelled(v)}" for k, v in sorted(options.items()))


def _spelled(value: OptionValue) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def known_options(algo: Recipe) -> dict[str, str]:
    """``{option: the values it takes}`` of the recipe ``algo``."""
    known: dict[str, str] = {}
    if len(algo.allowed_group_sizes) > 1:
        known["group_size"] = " / ".join(map(str, algo.allowed_group_sizes))
    if algo.smoothquant_alpha is not None:
        known["alpha"] = "a number in [0, 1]"
    if _has_conventions(algo):
        known["scales"] = " / ".join(SCALE_CONVENTIONS)
    if algo.awq:
        known["clip"] = "true / false"
    if algo.gptq:
        known["actorder"] = " / ".join(GPTQ_ACTORDERS)
        known["dampening"] = "a number in [0, 1]"
    return known


def _has_conventions(algo: Recipe) -> bool:
    """The ``scales`` option changes ``algo``'s scales: calibrated ones, AWQ's and GPTQ's, and
    row / group scales compressed-tensors computes otherwise (its scheme's ``scale_divisor``)."""
    spec = get_format(algo.weight)
    ct = spec.compressed_tensors
    return spec.calibrated or algo.awq or algo.gptq or (ct is not None and bool(ct.scale_divisor))


def apply_options(algo: Recipe, options: Mapping[str, OptionValue]) -> Recipe:
    """``algo`` with ``options`` applied (see the module docstring).

    Raises:
        UnknownOptionError: an option the recipe does not take, naming those it does.
        InvalidRecipeError: a value the option cannot take, naming those it can.
    """
    known = known_options(algo)
    unknown = [key for key in options if key not in known]
    if unknown:
        raise UnknownOptionError(f"quantization recipe {algo.name!r}", unknown, list(known))
    changes: dict[str, object] = {}
    if "group_size" in options:
        size = options["group_size"]
        if isinstance(size, bool) or size not in algo.allowed_group_sizes:
            raise InvalidRecipeError(
                f"recipe {algo.name!r}: group_size={size!r} is not one it takes "
                f"({known['group_size']})"
            )
        changes["group_size"] = int(size)
    if "alpha" in options:
        alpha = options["alpha"]
        if isinstance(alpha, bool) or not isinstance(alpha, int | float):
            raise InvalidRecipeError(
                f"recipe {algo.name!r}: alpha={alpha!r} is not a number in [0, 1]"
            )
        if not (math.isfinite(alpha) and 0.0 <= alpha <= 1.0):
            raise InvalidRecipeError(f"recipe {algo.name!r}: alpha={alpha!r} is not in [0, 1]")
        changes["smoothquant_alpha"] = float(alpha)
    if "scales" in options:
        convention = str(options["scales"]).replace("_", "-")
        if convention not in SCALE_CONVENTIONS:
            raise InvalidRecipeError(
                f"recipe {algo.name!r}: scales={options['scales']!r} is not one it takes "
                f"({known['scales']})"
            )
        changes["scales"] = convention
        options = {**options, "scales": convention}
    if "clip" in options:
        if not isinstance(options["clip"], bool):
            raise InvalidRecipeError(
                f"recipe {algo.name!r}: clip={options['clip']!r} is not one it takes "
                f"({known['clip']})"
            )
        changes["awq_clip"] = options["clip"]
    changes.update(_gptq_changes(algo, options, known))
    changes["spelled"] = spell(algo.name, options)
    return dataclasses.replace(algo, **changes)  # type: ignore[arg-type]


def _gptq_changes(
    algo: Recipe, options: Mapping[str, OptionValue], known: Mapping[str, str]
) -> dict[str, object]:
    """GPTQ's ``actorder`` and ``dampening`` options as the record's fields."""
    changes: dict[str, object] = {}
    for key, value in options.items():  # a recipe option, not a checkpoint config's key
        if key == "actorder":
            if str(value) not in GPTQ_ACTORDERS:
                raise InvalidRecipeError(
                    f"recipe {algo.name!r}: actorder={value!r} is not one it takes ({known[key]}; "
                    "'group' would need a g_idx tensor neither layout writes)"
                )
            changes["gptq_actorder"] = str(value)
        elif key == "dampening":
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidRecipeError(
                    f"recipe {algo.name!r}: dampening={value!r} is not a number in [0, 1]"
                )
            if not (math.isfinite(value) and 0.0 <= value <= 1.0):
                raise InvalidRecipeError(
                    f"recipe {algo.name!r}: dampening={value!r} is not in [0, 1]"
                )
            changes["gptq_dampening"] = float(value)
    return changes
