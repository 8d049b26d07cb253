"""What the shards store beyond the model (internal to :mod:`exportlm.stream`).

:func:`left_out`: tensors the model has no place for, which the streamed export names
as the in-memory one does (transformers' unexpected keys).

:func:`check_stored_ties`: a tied pair stored twice, with different values. A config
that ties ``lm_head`` to the embedding, over shards that store both tensors with
different values, is two models: transformers keeps the stored ``lm_head``, vLLM loads
one tensor into the tied pair. The in-memory export refuses it
(``resolve_tied_weights``: declared tied, but they differ); the streamed one read the
embedding for both and wrote one copy, silently. Compared here, before a layer is read,
from the bytes on disk in chunks (no tensor of either is held whole): equal bytes are
equal tensors.
"""

from __future__ import annotations

import re
from typing import Any

from exportlm.errors import TiedWeightsError

__all__ = ["check_stored_ties", "left_out"]

_CHUNK = 16 << 20


def check_stored_ties(source: Any, ties: dict[str, str]) -> None:
    """Refuse a declared tie (``{dropped: kept}``) whose two names the shards store differently.

    Raises:
        TiedWeightsError: naming both tensors and what to do.
    """
    for dropped, kept in ties.items():
        if dropped in source.shard_of and kept in source.shard_of:
            detail = _difference(source, dropped, kept)
            if detail is not None:
                raise TiedWeightsError(
                    f"{source.directory}: {dropped!r} is declared tied to {kept!r} "
                    f"(config.json: tie_word_embeddings) but the shards store both, and they "
                    f"differ ({detail}); transformers loads both, an engine that ties them "
                    "(vLLM) one tensor for both, and writing one copy would lose weights. "
                    "Set tie_word_embeddings to false in config.json, or remove the stored "
                    f"{dropped!r}"
                )


def _difference(source: Any, a: str, b: str) -> str | None:
    """How stored tensors ``a`` and ``b`` differ, ``None`` when their bytes are equal."""
    (start_a, infos_a), (start_b, infos_b) = (source.header(source.shard_of[n]) for n in (a, b))
    info_a, info_b = infos_a.get(a), infos_b.get(b)
    if info_a is None or info_b is None:
        return None  # reading the layer names the tensor missing from its shard
    if (info_a.dtype, tuple(info_a.shape)) != (info_b.dtype, tuple(info_b.shape)):
        return f"{info_a.dtype} {list(info_a.shape)} vs {info_b.dtype} {list(info_b.shape)}"
    (begin_a, end_a), (begin_b, _) = info_a.offsets, info_b.offsets
    path_a, path_b = (source.directory / source.shard_of[n] for n in (a, b))
    with open(path_a, "rb") as fa, open(path_b, "rb") as fb:
        fa.seek(start_a + begin_a)
        fb.seek(start_b + begin_b)
        left = end_a - begin_a
        while left > 0:
            size = min(left, _CHUNK)
            if fa.read(size) != fb.read(size):
                return "their stored bytes differ"
            left -= size
    return None


def left_out(source: Any) -> list[str]:
    """The tensors ``source`` (a ``CheckpointSource``) stores and its model has no place
    for, sorted: what ``from_pretrained`` reports as unexpected keys, its ignore patterns
    applied as its ``_adjust_missing_and_unexpected_keys`` applies them (the class's
    ``_keys_to_ignore_on_load_unexpected``; a stored ``rotary_emb.inv_freq`` /
    ``position_ids`` where the model has such buffers)."""
    model = source.model
    buffers = {name for name, _ in model.named_buffers()}
    known = source.stored_names() | set(model.state_dict(keep_vars=True)) | buffers
    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in buffers):
        patterns.add(r"(^|\.)position_ids$")
    ignored = re.compile("|".join(f"({p})" for p in patterns)) if patterns else None
    return sorted(
        name
        for name in source.shard_of
        if name not in known and (ignored is None or ignored.search(name) is None)
    )
