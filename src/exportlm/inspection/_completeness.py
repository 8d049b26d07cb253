"""Every decoder layer present: the one rule the ``hf_checkpoint`` loader and ``inspect`` share.

A checkpoint stores decoder block ``i`` under ``<prefix>.layers.{i}.`` (also
``h.{i}`` / ``blocks.{i}``). Its config's ``num_hidden_layers`` (the text config's,
for a multimodal one) says how many there are. Layers missing from the stored
tensors (a shard left behind, a layer skipped by a resumed export) are built by
transformers from random weights, silently; a layer count far beyond the stored
ones would make a loader build (and hang on) millions of layers.

:func:`layer_gap` compares the two without building anything: the indices are
read off the tensor names, and a missing run is described as a range, so a
``num_hidden_layers`` of ``10**12`` costs nothing. The decoder is the one prefix
holding layers, or among several (a vision tower beside the language model) the
one naming the language model; with none of those the rule does not apply.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["LayerGap", "layer_count_of", "layer_gap"]

_LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?(?:layers|h|blocks))\.(?P<index>\d+)\.")
_DECODER_HINTS = ("language_model", "text_model", "decoder")


@dataclass(frozen=True)
class LayerGap:
    """Decoder layers the config counts and the shards do not store, or store beyond it.

    Attributes:
        count: ``num_hidden_layers``.
        prefix: where the layers are stored (``model.layers``).
        stored: the stored indices, sorted.
        missing: the missing indices as text (``"1"``, ``"2..99999"``); ``""`` if none.
        extra: stored indices at or beyond ``count``.
    """

    count: int
    prefix: str
    stored: tuple[int, ...]
    missing: str
    extra: tuple[int, ...]

    def message(self) -> str:
        """What is wrong, and what to do."""
        said = []
        if self.missing:
            said.append(f"layer(s) {self.missing} are missing (no {self.prefix}.N.* tensor)")
        if self.extra:
            said.append(f"layer(s) {_ranges(self.extra)} are beyond it")
        why = (
            "a loader would build the missing layers from random weights"
            if self.missing
            else "loaders drop them or fail on them"
        )
        return (
            f"config.json: num_hidden_layers is {self.count}, but the shards store "
            f"{self.prefix} {_ranges(self.stored)} ({len(self.stored)} of them): "
            f"{'; '.join(said)}. So {why}; copy every shard, or fix num_hidden_layers"
        )


def layer_count_of(config: Mapping[str, Any]) -> Any:
    """``num_hidden_layers`` of a ``config.json`` dict (its ``text_config``'s when it has one)."""
    text = config.get("text_config")
    if "num_hidden_layers" not in config and isinstance(text, Mapping):
        return text.get("num_hidden_layers")
    return config.get("num_hidden_layers")


def layer_gap(count: Any, names: Iterable[str]) -> LayerGap | None:
    """The decoder layers ``count`` and the tensor ``names`` disagree on; ``None`` when they agree.

    Also ``None`` when ``count`` is not a positive int (the config rules report
    that) or no decoder layers are found in the names.
    """
    if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
        return None
    groups: dict[str, set[int]] = {}
    for name in names:
        match = _LAYER.match(name)
        if match:
            groups.setdefault(match["prefix"], set()).add(int(match["index"]))
    prefix = _decoder(groups)
    if prefix is None:
        return None
    stored = tuple(sorted(groups[prefix]))
    missing = _gaps([i for i in stored if i < count], count)
    extra = tuple(i for i in stored if i >= count)
    if not missing and not extra:
        return None
    return LayerGap(count, prefix, stored, missing, extra)


def _gaps(present: list[int], count: int) -> str:
    """The indices of ``0..count-1`` not in sorted ``present``, as ranges (never enumerated)."""
    gaps, expected = [], 0
    for i in [*present, count]:
        if i > expected:
            gaps.append(str(expected) if i - 1 == expected else f"{expected}..{i - 1}")
        expected = i + 1
    return ", ".join(gaps)


def _decoder(groups: Mapping[str, set[int]]) -> str | None:
    if len(groups) == 1:
        return next(iter(groups))
    named = [p for p in groups if any(hint in p for hint in _DECODER_HINTS)]
    return named[0] if len(named) == 1 else None


def _ranges(indices: Iterable[int]) -> str:
    """``"0, 2..5, 9"`` for sorted ``indices``."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)
