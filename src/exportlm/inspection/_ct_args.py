"""compressed-tensors quantization args that its own validation refuses.

vLLM, SGLang and transformers parse every ``config_groups`` entry (and the
``kv_cache_scheme``) with compressed-tensors' ``QuantizationArgs``, whose validators
refuse, before any tensor is read (compressed-tensors 0.17, vLLM 0.32's, to 0.20:
``quantization/quant_args.py``, ``validate_group``, ``validate_block_structure``,
``validate_strategy``, ``validate_model_after``):

* a ``strategy`` that is none of its strategies (matched lower-cased);
* a ``group`` / ``tensor_group`` strategy without a positive ``group_size``, and a
  positive ``group_size`` under any other strategy; a ``group_size`` below -1;
* a ``block`` strategy without ``block_structure``, a ``block_structure`` under any
  other strategy, and one that is not two positive ints ``[rows, cols]`` (or the
  older ``"RxC"`` string);
* a static ``token`` strategy (per-token scales exist only at run time), and dynamic
  args of a strategy other than ``token``, ``tensor``, ``group`` or ``tensor_group``
  (``"local"``: ``tensor_group`` only).

Each is a ``config-field-invalid`` finding: the checkpoint fails at load in every
loader that reads the layout. (compressed-tensors before 0.19 takes a ``block_structure``
of ints of any sign; vLLM 0.32, with 0.17, then fails at load on a tile of 0 with
``ZeroDivisionError``: measured.)
"""

from __future__ import annotations

from typing import Any

from exportlm.checkpoint import QuantArgs

__all__ = ["args_problems"]

_GROUPED = ("group", "tensor_group")
_DYNAMIC = ("token", "tensor", "group", "tensor_group")
#: compressed-tensors' ``QuantizationStrategy`` values (matched lower-cased, as it does).
STRATEGIES = ("tensor", "channel", "group", "block", "token", "tensor_group", "attn_head")


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _tile(value: Any) -> bool:
    """Whether compressed-tensors takes ``value`` as a block structure."""
    if isinstance(value, str):  # the older "RxC" form
        try:
            value = [int(x) for x in value.split("x")]
        except ValueError:
            return False
    return (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(isinstance(v, int) and v > 0 for v in value)
    )


def args_problems(args: QuantArgs | None, where: str) -> list[str]:
    """What compressed-tensors' validation refuses in ``args`` (``where``: their key path)."""
    if args is None:
        return []
    strategy = args.strategy.lower() if isinstance(args.strategy, str) else args.strategy
    size, tile = args.group_size, args.block_structure
    if strategy is not None and strategy not in STRATEGIES:
        return [f"{where}.strategy is {args.strategy!r}, expected one of {', '.join(STRATEGIES)}"]
    found: list[str] = []
    if size is not None and (_int(size) is None or size < -1 or (size == 0 and strategy is None)):
        found.append(f"{where}.group_size is {size!r}, expected a positive int (or -1: channel)")
    elif strategy in _GROUPED and (size is None or size <= 0):
        found.append(f"{where}: strategy {strategy!r} needs a positive group_size; got {size!r}")
    elif strategy is not None and strategy not in _GROUPED and size is not None and size > 0:
        found.append(
            f"{where}: group_size {size} needs strategy 'group' or 'tensor_group'; got {strategy!r}"
        )
    if strategy == "block" and not _tile(tile):
        found.append(
            f"{where}: strategy 'block' needs block_structure [rows, cols] of two positive "
            f"ints; got {tile!r}"
        )
    elif strategy != "block" and tile is not None:
        found.append(f"{where}: block_structure {tile!r} needs strategy 'block'; got {strategy!r}")
    if strategy == "token" and not args.dynamic:
        found.append(f"{where}: strategy 'token' is per-token at run time: dynamic must be true")
    effective = strategy or _inferred(size)
    if args.dynamic and effective not in _DYNAMIC:
        found.append(
            f"{where}: dynamic args need strategy {', '.join(_DYNAMIC)}; got {effective!r}"
        )
    elif args.dynamic == "local" and effective != "tensor_group":
        found.append(f"{where}: dynamic 'local' needs strategy 'tensor_group'; got {effective!r}")
    return found


def _inferred(size: Any) -> str | None:
    """The strategy compressed-tensors infers from ``group_size`` when none is written."""
    if size is None:
        return "tensor"
    return "channel" if size == -1 else "group" if _int(size) and size > 0 else None
