"""The past-key-values graph interface shared by the ``onnx`` and ``torch_export`` targets.

An export with ``kv_cache=True`` traces :class:`PastKVWrapper` instead of the
logits-only ``ExportCacheWrapper``: one graph that takes ``input_ids`` and the
flat past key/values of every layer and returns the logits and the flat present
key/values (past followed by the new positions)::

    input_ids [batch, sequence], past_key_values.{i}.key|value [batch, kv_heads, past_sequence, head_dim]
      -> logits [batch, sequence, vocab], present.{i}.key|value [batch, kv_heads, past_sequence + sequence, head_dim]

:class:`MaskedPastKVWrapper` (the ``onnx`` target's graph) also takes, as Optimum's
exporter names them, ``attention_mask`` ``[batch, past_sequence + sequence]`` (int64,
1 = real token, 0 = padding) and, for a model whose forward takes them,
``position_ids`` ``[batch, sequence]`` (int64), so that a left-padded batch gives
each row the logits of that prompt alone (:func:`positions_from_mask`).

The past length is dynamic down to 0: the prefill is the same graph fed empty
past tensors. These are the names Optimum and onnxruntime-genai use.

Two cache interfaces are recognised (:func:`probe_past_layout`):

* transformers models: the forward takes ``cache`` (transformers >= 5.24) or
  ``past_key_values`` and ``use_cache``; the wrapper builds a ``DynamicCache``
  of full-length layers from the flat tensors, passes ``position_ids`` that start
  after the past (or the graph's ``position_ids``), and flattens the returned
  cache. Sliding-window layers (``gpt_oss``) keep their whole history in this
  interface: the model's sliding-window mask still hides what lies outside the
  window, so the logits are the model's, at the memory cost of a full-length cache.
* plain torch models such as :class:`~exportlm.models.DecoderModel`: the forward
  takes ``past_key_values`` as a tuple of ``(key, value)`` per layer and
  ``use_cache``, and returns ``(logits, cache)`` in the same form. Its positions
  are its own (``DecoderModel`` counts them from the past length, padding included).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from exportlm._transformers_model import is_transformers_model
from exportlm.errors import InvalidModelError
from exportlm.export._wrapper import extract_logits

__all__ = [
    "MaskOnlyPastKVWrapper",
    "MaskedPastKVWrapper",
    "PastKVWrapper",
    "PastLayout",
    "cache_pairs",
    "example_past",
    "flat_past_names",
    "past_dynamic_shapes",
    "positions_from_mask",
    "probe_past_layout",
    "split_cache",
]

#: Names of the dynamic axes of a past-key-values graph.
BATCH, SEQUENCE, PAST = "batch", "sequence", "past_sequence"

_HOW_TO = (
    "Export without kv_cache=True (logits only), or give the model a forward that takes "
    "past_key_values (a (key, value) pair per layer) and use_cache=True and returns "
    "(logits, cache), as exportlm.models.DecoderModel does"
)


@dataclass(frozen=True)
class PastLayout:
    """The shape of a model's KV cache, as the past-key-values graph carries it.

    Attributes:
        heads: per layer, the ``(kv_heads, head_dim)`` of its key and value tensors.
        dtype: the dtype of the cached tensors.
        style: ``"transformers"`` (a ``Cache`` object) or ``"tuple"`` (``(key, value)`` pairs).
        cache_arg: the forward's keyword for the past (``"cache"`` or ``"past_key_values"``).
        position_ids: the forward takes ``position_ids`` (given explicitly, after the past).
        attention_mask: the forward takes ``attention_mask`` (a 2-D padding mask over
            past and new positions).
    """

    heads: tuple[tuple[int, int], ...]
    dtype: torch.dtype
    style: Literal["transformers", "tuple"]
    cache_arg: str
    position_ids: bool = False
    attention_mask: bool = False

    @property
    def num_layers(self) -> int:
        """Number of layers with a cache (one ``key`` / ``value`` pair each)."""
        return len(self.heads)


def flat_past_names(num_layers: int, prefix: str) -> list[str]:
    """``{prefix}.{i}.key``, ``{prefix}.{i}.value`` for every layer, in graph order."""
    return [f"{prefix}.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]


def past_dynamic_shapes(
    num_layers: int, *, attention_mask: bool = False, position_ids: bool = False
) -> dict[str, Any]:
    """``dynamic_shapes`` of :class:`PastKVWrapper` (or, with ``attention_mask``, of
    :class:`MaskedPastKVWrapper`) for ``torch.export`` / ``torch.onnx``.

    Batch and sequence are at least 1, the past length at least 0 (the prefill).
    The mask's length is ``past + sequence``, a relation ``torch.export`` derives
    from the graph, so its axis is left to it (``Dim.DYNAMIC``).
    """
    batch = torch.export.Dim(BATCH, min=1)
    sequence = torch.export.Dim(SEQUENCE, min=1)
    past = torch.export.Dim(PAST, min=0)
    shapes: dict[str, Any] = {"input_ids": {0: batch, 1: sequence}}
    if attention_mask:
        shapes["attention_mask"] = {0: batch, 1: torch.export.Dim.DYNAMIC}
        if position_ids:
            shapes["position_ids"] = {0: batch, 1: sequence}
    shapes["past"] = tuple({0: batch, 2: past} for _ in range(2 * num_layers))
    return shapes


def positions_from_mask(attention_mask: torch.Tensor, sequence: int) -> torch.Tensor:
    """``position_ids`` ``[batch, sequence]`` of the last ``sequence`` positions of a padding mask.

    As transformers' ``generate`` and Optimum compute them: the count of real tokens
    before each position (``cumsum - 1``), and 1 on padding, so a left-padded row
    numbers its first real token 0, as that prompt alone would.
    """
    mask = attention_mask.long()
    positions = mask.cumsum(-1) - 1
    positions = positions.masked_fill(mask == 0, 1)
    return positions[:, -sequence:]


def example_past(
    layout: PastLayout, input_ids: torch.Tensor, length: int = 3
) -> tuple[torch.Tensor, ...]:
    """Zero past key/values of ``length`` positions for tracing (the graph runs from 0 up).

    A non-zero, non-one length: ``torch.export`` specializes example sizes 0 and 1.
    """
    return tuple(
        torch.zeros(
            (input_ids.shape[0], heads, length, dim), dtype=layout.dtype, device=input_ids.device
        )
        for heads, dim in layout.heads
        for _ in ("key", "value")
    )


def _forward_params(model: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _cache_arg(params: set[str]) -> str | None:
    if "use_cache" not in params:
        return None
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    return None


def split_cache(output: Any, style: str, where: str) -> tuple[torch.Tensor, Any]:
    """``(logits, cache)`` of a forward run with ``use_cache=True``."""
    logits = extract_logits(output, where=where)
    if style == "transformers":
        cache = getattr(output, "cache", None)
        if cache is None:
            cache = getattr(output, "past_key_values", None)
    else:
        cache = output[1] if isinstance(output, (tuple, list)) and len(output) == 2 else None
    if cache is None:
        raise InvalidModelError(
            f"{where} forward with use_cache=True returned no cache beside the logits; "
            f"expected (logits, cache) or an output with .cache / .past_key_values. {_HOW_TO}"
        )
    return logits, cache


def _pair(layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(key, value)`` of one cache layer (a transformers layer or a tuple), else ``None``."""
    if isinstance(layer, (tuple, list)):
        key, value = (layer[0], layer[1]) if len(layer) >= 2 else (None, None)
    else:
        key, value = getattr(layer, "keys", None), getattr(layer, "values", None)
    if not (isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)):
        return None
    return (key, value) if key.dim() == value.dim() == 4 else None


def cache_pairs(cache: Any, where: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``(key, value)`` tensors of every layer of a transformers ``Cache`` or a tuple cache."""
    layers = getattr(cache, "layers", cache)
    pairs = [_pair(layer) for layer in layers] if isinstance(layers, (tuple, list)) else []
    found = [pair for pair in pairs if pair is not None]
    if not found or len(found) != len(pairs):
        raise InvalidModelError(
            f"{where} returned a cache of type {type(cache).__name__} that is not one 4-D "
            f"(key, value) pair [batch, kv_heads, seq, head_dim] per layer. {_HOW_TO}"
        )
    return found


def probe_past_layout(model: nn.Module) -> PastLayout:
    """The KV-cache layout of ``model``, found by one eager forward with ``use_cache=True``.

    Raises:
        InvalidModelError: the model has no cache interface the past-key-values graph
            can carry (no ``use_cache`` / ``past_key_values`` arguments, or a cache that
            is not a ``(key, value)`` pair of 4-D tensors per layer); the message says
            what to do.
    """
    name = type(model).__name__
    params = _forward_params(model)
    cache_arg = _cache_arg(params)
    if cache_arg is None:
        raise InvalidModelError(
            f"{name}.forward takes no use_cache and past_key_values (or cache) arguments, so "
            f"it has no KV cache to export. {_HOW_TO}"
        )
    style: Literal["transformers", "tuple"] = (
        "transformers" if is_transformers_model(model) else "tuple"
    )
    ids = torch.zeros((1, 2), dtype=torch.long, device=_device(model))
    try:
        with torch.no_grad():
            output = model(ids, use_cache=True)
    except Exception as err:
        raise InvalidModelError(
            f"{name} failed a probe forward with use_cache=True ({type(err).__name__}: {err}). "
            f"{_HOW_TO}"
        ) from err
    _, cache = split_cache(output, style, name)
    pairs = cache_pairs(cache, name)
    heads = tuple((int(k.shape[1]), int(k.shape[3])) for k, _ in pairs)
    for layer, (k, v) in enumerate(pairs):
        if k.shape != v.shape or k.shape[2] != ids.shape[1]:
            raise InvalidModelError(
                f"{name}: layer {layer} caches key {list(k.shape)} and value {list(v.shape)} "
                f"after a {ids.shape[1]}-token prompt; expected equal shapes that hold every "
                f"token. {_HOW_TO}"
            )
    positions = style == "transformers" and "position_ids" in params
    masked = "attention_mask" in params
    return PastLayout(heads, pairs[0][0].dtype, style, cache_arg, positions, masked)


def _device(model: nn.Module) -> torch.device:
    for tensor in [*model.parameters(), *model.buffers()]:
        return tensor.device
    return torch.device("cpu")


class PastKVWrapper(nn.Module):
    """``forward(input_ids, past) -> (logits, *present)`` over flat key/value tensors.

    ``past`` is ``(key_0, value_0, key_1, value_1, ...)`` of shape
    ``[batch, kv_heads, past, head_dim]`` (``past`` may be 0); ``present`` is the
    same with ``past + sequence`` positions. The wrapped model is shared, not copied.
    """

    def __init__(self, model: nn.Module, layout: PastLayout) -> None:
        super().__init__()
        self.model = model
        self.layout = layout

    def forward(
        self, input_ids: torch.Tensor, past: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """Run ``input_ids`` after ``past``; returns the logits and the flat present."""
        return self._run(input_ids, past, None, None)

    def _run(
        self,
        input_ids: torch.Tensor,
        past: Sequence[torch.Tensor],
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        where = type(self.model).__name__
        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(self.layout.num_layers)]
        kwargs: dict[str, Any] = {"use_cache": True}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if self.layout.style == "transformers":
            from transformers import DynamicCache

            cache = DynamicCache()
            for layer, (key, value) in enumerate(pairs):
                cache.update(key, value, layer)
            kwargs[self.layout.cache_arg] = cache
            if self.layout.position_ids:
                if position_ids is None:
                    start = pairs[0][0].shape[2]
                    positions = torch.arange(input_ids.shape[1], device=input_ids.device) + start
                    position_ids = positions.unsqueeze(0).expand(input_ids.shape[0], -1)
                kwargs["position_ids"] = position_ids
        else:
            kwargs[self.layout.cache_arg] = tuple(pairs)
        logits, cache_out = split_cache(self.model(input_ids, **kwargs), self.layout.style, where)
        present = cache_pairs(cache_out, where)
        return (logits, *[t for pair in present for t in pair])


class MaskedPastKVWrapper(PastKVWrapper):
    """``forward(input_ids, attention_mask, position_ids, past) -> (logits, *present)``.

    The graph Optimum's exporter writes: ``attention_mask`` ``[batch, past + sequence]``
    hides padded positions; ``position_ids`` ``[batch, sequence]`` (``None`` for a model
    whose forward takes none: use :class:`MaskOnlyPastKVWrapper`) places each new token.
    """

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past: Sequence[torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        """Run ``input_ids`` after ``past`` under ``attention_mask``; logits and the flat present."""
        return self._run(input_ids, past, attention_mask, position_ids)


class MaskOnlyPastKVWrapper(PastKVWrapper):
    """``forward(input_ids, attention_mask, past) -> (logits, *present)``: a masked graph of a
    model whose forward takes no ``position_ids`` (it places tokens itself)."""

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, past: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """Run ``input_ids`` after ``past`` under ``attention_mask``; logits and the flat present."""
        return self._run(input_ids, past, attention_mask, None)
