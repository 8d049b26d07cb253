"""``ExportCacheWrapper``: one clean ``input_ids -> logits`` graph for every trace-based target."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from exportlm.errors import InvalidModelError

__all__ = ["ExportCacheWrapper", "extract_logits"]


def extract_logits(output: Any, *, where: str = "model") -> torch.Tensor:
    """Pull the logits out of a forward's output.

    Accepts a tensor, a ``(logits, ...)`` tuple/list, a mapping with ``"logits"``
    or an object with a ``.logits`` attribute (transformers' ``ModelOutput``).
    """
    logits: Any = None
    if isinstance(output, torch.Tensor):
        logits = output
    elif hasattr(output, "logits") and isinstance(output.logits, torch.Tensor):
        logits = output.logits
    elif isinstance(output, dict) and isinstance(output.get("logits"), torch.Tensor):
        logits = output["logits"]
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        logits = output[0]
    if logits is None or not logits.is_floating_point() or logits.dim() < 2:
        raise InvalidModelError(
            f"{where} forward returned {type(output).__name__}"
            + (
                f" with a {tuple(logits.shape)} {logits.dtype} tensor"
                if isinstance(logits, torch.Tensor)
                else ""
            )
            + "; expected logits: a float tensor [batch, seq, vocab], a (logits, cache) tuple, "
            "or an object with a .logits tensor"
        )
    result: torch.Tensor = logits
    return result


class ExportCacheWrapper(nn.Module):
    """Wrap a decoder so tracing sees ``forward(input_ids, [attention_mask]) -> logits``.

    Forces ``use_cache=False`` (and ``return_dict`` where supported) so no KV cache
    object enters the graph, then unwraps ``(logits, kv_cache)`` / ``ModelOutput`` to
    the logits tensor. The wrapped model is shared, not copied, and not modified.
    """

    def __init__(self, model: nn.Module, *, pass_attention_mask: bool = False) -> None:
        super().__init__()
        self.model = model
        self.pass_attention_mask = pass_attention_mask
        params = _forward_params(model)
        self._kwargs: dict[str, Any] = {}
        if "use_cache" in params:
            self._kwargs["use_cache"] = False
        self._accepts_mask = "attention_mask" in params

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        kwargs = dict(self._kwargs)
        if attention_mask is not None and self._accepts_mask:
            kwargs["attention_mask"] = attention_mask
        output = self.model(input_ids, **kwargs)
        return extract_logits(output, where=type(self.model).__name__)


def _forward_params(model: nn.Module) -> set[str]:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return set()
    names = set(params)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        names.add("use_cache")
        names.add("attention_mask")
    return names


def accepts_attention_mask(model: nn.Module) -> bool:
    """True when ``model.forward`` takes an ``attention_mask`` argument."""
    return "attention_mask" in _forward_params(model)
