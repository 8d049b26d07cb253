"""``quant_method: "fp8"`` (DeepSeek-V3 / Qwen3-FP8, ``format="finegrained-fp8"``) held to its loaders.

Two loaders read the section, each with its own defaults, so a field one of them
would read differently from the other is a ``config-field-invalid`` finding (the
``hf_checkpoint`` loader refuses it):

* ``weight_block_size``: absent, transformers takes ``(128, 128)``
  (``utils/quantization_config.py`` ``FineGrainedFP8Config.__init__``) and vLLM per-tensor
  scales (``quantization/fp8.py`` ``Fp8Config.from_config``: ``get_from_keys_or(...,
  None)``); else a list of two positive ints (both ``post_init`` / ``__init__`` check it);
* ``activation_scheme``: required by vLLM (``get_from_keys``), one of ``static`` /
  ``dynamic``, and ``dynamic`` with a block size (``Fp8Config.__init__``);
* ``scale_fmt``: ``float`` or ``ue8m0`` (``FineGrainedFP8Config.post_init``);
* the unquantized modules: lists of module names; transformers reads
  ``modules_to_not_convert`` (``ignored_layers`` only without it), vLLM ``ignored_layers``
  (``modules_to_not_convert`` only without it), so both present must agree.

What is valid but not this exporter's format (``scale_fmt: ue8m0``, FP4 experts,
non-square tiles) is for the reader that maps formats to say.

:func:`transformers_tile_misread` is a ``loader-misreads`` verdict: transformers'
dequantizing load (its CPU path) takes the tile from the scale grid, so a weight
whose output rows do not fill the last of several tiles is read with the wrong tile.
"""

from __future__ import annotations

from typing import Any

from exportlm.checkpoint import FineGrainedFP8, Section
from exportlm.inspection._declared import Declared
from exportlm.inspection._files import Checkpoint
from exportlm.inspection._loaders import Misread, _transformers_label, transformers_quant_methods

__all__ = ["finegrained_problems", "transformers_tile_misread"]

_CONFIG = "config.json"
_SCHEMES = ("static", "dynamic")  # vLLM's ACTIVATION_SCHEMES (quantization/fp8.py)


def _names(value: Any) -> bool:
    return value is None or (isinstance(value, list) and all(isinstance(v, str) for v in value))


def _block_problem(fields: FineGrainedFP8) -> str | None:
    size = fields.weight_block_size
    if not fields.has_block_size:
        return (
            "weight_block_size is absent: transformers would read 128 x 128 tiles and vLLM "
            "per-tensor scales; write it ([128, 128]) or null"
        )
    if size is None:
        return None
    ints = isinstance(size, list) and len(size) == 2
    if not (ints and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)):
        return f"weight_block_size is {size!r}, expected two positive ints ([128, 128])"
    return None


def _problems(fields: FineGrainedFP8) -> list[str]:
    found = [why] if (why := _block_problem(fields)) else []
    scheme = fields.activation_scheme
    if scheme not in _SCHEMES:
        found.append(f"activation_scheme is {scheme!r}, expected 'dynamic' or 'static'")
    elif scheme != "dynamic" and fields.weight_block_size is not None:
        found.append(
            f"activation_scheme {scheme!r} with weight_block_size: vLLM takes only 'dynamic'"
        )
    if fields.scale_fmt not in (None, "float", "ue8m0"):
        found.append(f"scale_fmt is {fields.scale_fmt!r}, expected 'float' or 'ue8m0'")
    for key in ("modules_to_not_convert", "ignored_layers", "modules_to_convert"):
        if not _names(getattr(fields, key)):
            found.append(f"{key} is {getattr(fields, key)!r}, expected a list of module names")
    skip, ignored = fields.modules_to_not_convert, fields.ignored_layers
    if skip and ignored and sorted(map(str, skip)) != sorted(map(str, ignored)):
        found.append(
            "modules_to_not_convert and ignored_layers differ: transformers leaves the first "
            "unquantized and vLLM the second; keep one of them"
        )
    return found


def finegrained_problems(section: Section) -> list[tuple[str, str, str]]:
    """``(rule, subject, message)`` of every field the two loaders would not read alike."""
    if section.finegrained is None:
        return []
    where = f"{_CONFIG} quantization_config (quant_method 'fp8')"
    return [
        ("config-field-invalid", _CONFIG, f"{where}: {why}")
        for why in _problems(section.finegrained)
    ]


_SCALE_INV = ".weight_scale_inv"


def _partial_tiles(checkpoint: Checkpoint, block: int) -> list[str]:
    """The weights whose output rows span several tiles of ``block``, the last one partial."""
    found = []
    for name in sorted(checkpoint.tensors):
        weight = checkpoint.tensors.get(name.removesuffix(_SCALE_INV) + ".weight")
        if not name.endswith(_SCALE_INV) or weight is None or len(weight.shape) < 2:
            continue
        rows = weight.shape[-2]
        if rows % block and -(-rows // block) > 1:
            found.append(weight.name)
    return found


def transformers_tile_misread(checkpoint: Checkpoint, declared: Declared) -> Misread | None:
    """transformers' misread of a finegrained-fp8 weight with a partial last row tile.

    Without a GPU it dequantizes while loading (``quantizer_finegrained_fp8.py``
    ``validate_environment``), and ``Fp8Dequantize._dequantize_one`` takes the tile as
    ``rows // scale_rows``: with ``ceil(rows / b)`` scale rows and ``rows`` not a multiple of
    ``b`` it raises where that does not divide and reads every tile with the wrong edge
    where it does (192 rows in tiles of 128: two scale rows read as tiles of 96).
    """
    scheme = declared.default
    block = scheme.group_size if scheme is not None else None
    label = _transformers_label()
    methods = transformers_quant_methods() or ()
    if declared.layout != "finegrained-fp8" or not block or label is None or "fp8" not in methods:
        return None
    partial = _partial_tiles(checkpoint, block)
    if not partial:
        return None
    return Misread(
        "transformers",
        label.split(" ", 1)[1],
        "fp8",
        frozenset(),
        frozenset(),
        frozenset(),
        f"{len(partial)} weight(s) (e.g. {partial[0]}) have output rows that do not fill the "
        f"last of several {block}-row tiles; its dequantizing load (no GPU) takes the tile "
        "from the scale grid (integrations/finegrained_fp8.py Fp8Dequantize: rows // scale "
        "rows) and refuses or misplaces them; vLLM and exportlm.load_exported read them "
        "right, or quantize with a group_size that divides the rows",
    )
