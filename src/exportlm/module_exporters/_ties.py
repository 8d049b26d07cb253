"""Tied weights: which tensors an export writes once, under which name, and the checks.

A tie is one weight reachable under two names (a tied ``lm_head.weight`` and
``embed_tokens.weight``). It is written once, under the tie's *source* name, as
``save_pretrained`` does (the embedding side); the other name is absent from the
checkpoint and recorded as tied in the export summary. Ties are found by name
(declarations) and by parameter identity, never by storage address.

When both modules of a tie are quantized, each exporter writes its own
quantized copy; the copies of the weight and of its scales
(:data:`QUANTIZED_WEIGHT_LEAVES`) must then be the same bytes, and only the
source's is written.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import nn

from exportlm.errors import TiedWeightsError
from exportlm.quant import is_quantized_module

__all__ = ["QUANTIZED_WEIGHT_LEAVES", "TieBook", "resolve_tied_weights", "tie_book"]

logger = logging.getLogger(__name__)

#: Tensors an exporter writes for a quantized ``weight``: the codes and their scales.
QUANTIZED_WEIGHT_LEAVES = ("weight", "weight_scale", "weight_scale_2")


def _declared_ties(model: nn.Module) -> dict[str, str]:
    """``{target: source}`` ties the model declares (transformers v5 dict or v4 list)."""
    config = getattr(model, "config", None)
    for flag in ("tie_word_embeddings", "tie_embeddings"):
        value = getattr(config, flag, None)
        if value is False:
            return {}
    expanded = getattr(model, "all_tied_weights_keys", None)
    if isinstance(expanded, Mapping) and expanded:
        return {str(k): str(v) for k, v in expanded.items()}
    declared = getattr(model, "_tied_weights_keys", None)
    if isinstance(declared, Mapping):
        return {str(k): str(v) for k, v in declared.items()}
    if isinstance(declared, (list, tuple)):  # transformers v4: targets tied to the input embeddings
        getter = getattr(model, "get_input_embeddings", None)
        embeddings = getter() if callable(getter) else None
        source = _param_name(model, getattr(embeddings, "weight", None))
        if source is not None:
            return {str(t): source for t in declared if str(t) != source}
    return {}


def _param_name(model: nn.Module, param: object) -> str | None:
    if param is None:
        return None
    for name, p in model.named_parameters(remove_duplicate=False):
        if p is param:
            return name
    return None


def _lookup(model: nn.Module, name: str) -> torch.Tensor | None:
    """The parameter or buffer ``name`` of ``model``, or ``None``."""
    for getter in (model.get_parameter, model.get_buffer):
        try:
            return getter(name)
        except AttributeError:
            continue
    return None


def resolve_tied_weights(model: nn.Module) -> dict[str, str]:
    """``{dropped name: kept name}`` for every tied tensor written once.

    Declared ties (``_tied_weights_keys`` / ``all_tied_weights_keys``, honoured
    only when the config ties embeddings) keep the source name, as
    ``save_pretrained`` does; undeclared sharing falls back to parameter
    *identity* (the same ``Parameter`` object under two names; the first name
    is kept). Storage addresses (``data_ptr``) are never compared: two distinct
    tensors that happen to share an address are both written.

    Raises :class:`TiedWeightsError` when declared-tied tensors differ.
    """
    dropped: dict[str, str] = {}
    for target, source in _declared_ties(model).items():
        a, b = _lookup(model, target), _lookup(model, source)
        if a is None or b is None:
            logger.debug("declared tie %s -> %s: a side is missing; ignored", target, source)
            continue
        if a is not b and not (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)):
            raise TiedWeightsError(_tie_diff_message(target, source, a, b))
        dropped[target] = source
    seen: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        kept = seen.setdefault(id(param), name)
        if kept != name and name not in dropped and kept not in dropped:
            dropped[name] = kept
    return dropped


def _tie_diff_message(target: str, source: str, a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        detail = f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    else:
        detail = f"max abs difference {(a.float() - b.float()).abs().max().item():.3g}"
    return (
        f"{target!r} is declared tied to {source!r} but they differ ({detail}); writing one "
        "copy would lose weights. Re-tie them (model.tie_weights()) or set "
        "config.tie_word_embeddings=False and drop the declaration."
    )


def tie_book(model: nn.Module) -> TieBook:
    """The ties of ``model`` as a :class:`TieBook` for one export.

    Raises :class:`TiedWeightsError` for differing declared ties and for a tie
    of which only one module is quantized (a quantized tensor cannot stand for
    its unquantized tie, nor the other way round).
    """
    dropped = resolve_tied_weights(model)
    compared: dict[str, str] = {}
    for target, source in dropped.items():
        target_owner, _, target_leaf = target.rpartition(".")
        source_owner, _, source_leaf = source.rpartition(".")
        quantized = [
            is_quantized_module(model.get_submodule(owner))
            for owner in (target_owner, source_owner)
        ]
        if quantized[0] != quantized[1]:
            which, other = (
                (target_owner, source_owner) if quantized[0] else (source_owner, target_owner)
            )
            raise TiedWeightsError(
                f"{target!r} is tied to {source!r}, but only {which!r} is quantized: its quantized "
                f"copy cannot stand for the full-precision {other!r} (or the other way round). "
                f"Quantize both with the same recipe, exclude {which!r} from quantization "
                f"(exclude=[{which!r}]), or untie the weights."
            )
        if quantized[0] and target_leaf == source_leaf == "weight":
            for leaf in QUANTIZED_WEIGHT_LEAVES:
                compared[f"{target_owner}.{leaf}"] = f"{source_owner}.{leaf}"
    verified = {t: s for t, s in dropped.items() if t not in compared}
    return TieBook(verified, compared)


class TieBook:
    """What one export writes under tied names.

    Args:
        verified: ``{dropped: kept}`` ties already known to hold one value (the
            same parameter, or declared ties compared equal): the driver does not
            write the dropped name (:meth:`drops`). An exporter that writes one
            anyway writes a second copy, which the export then holds.
        compared: ``{dropped: kept}`` quantized tensors two exporters each write
            for one tied weight: the dropped copy must be the same bytes as the
            kept one (checked whichever comes first), then it is not written
            (:meth:`absorbs`).
    """

    def __init__(
        self, verified: Mapping[str, str] | None = None, compared: Mapping[str, str] | None = None
    ) -> None:
        self.verified = dict(verified or {})
        self.compared = dict(compared or {})
        self._sources = set(self.compared.values())
        self._kept: dict[str, torch.Tensor] = {}
        self._waiting: dict[str, torch.Tensor] = {}

    @property
    def ties(self) -> dict[str, str]:
        """Every ``{dropped name: kept name}``."""
        return {**self.verified, **self.compared}

    def drops(self, name: str) -> bool:
        """True when the driver does not write ``name``: the dropped side of a verified tie."""
        return name in self.verified

    def absorbs(self, name: str, tensor: torch.Tensor) -> bool:
        """True when ``name`` is the dropped copy of a tied quantized tensor (not written).

        The copy is compared with the kept tensor, now or when that is written.
        """
        kept = self.compared.get(name)
        if kept is None:
            return False
        if kept in self._kept:
            _require_same_bytes(name, kept, tensor, self._kept[kept])
        else:
            self._waiting[name] = tensor
        return True

    def wrote(self, name: str, tensor: torch.Tensor) -> None:
        """``tensor`` was written under ``name``: compare the copies waiting for it."""
        if name not in self._sources:
            return
        self._kept[name] = tensor
        for dropped in [d for d in self._waiting if self.compared[d] == name]:
            _require_same_bytes(dropped, name, self._waiting.pop(dropped), tensor)

    def finish(self) -> None:
        """Raise if a dropped quantized copy's kept tensor was never written."""
        waiting = sorted(self._waiting)
        self._kept.clear()
        self._waiting.clear()
        if waiting:
            pairs = ", ".join(f"{d!r} -> {self.compared[d]!r}" for d in waiting)
            raise TiedWeightsError(
                f"tied quantized tensors {pairs}: the source of the tie was never written, so "
                "dropping the copy would lose the weight. The source module's exporter must "
                "write the same tensor names (weight, weight_scale, weight_scale_2)."
            )


def _require_same_bytes(dropped: str, kept: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """Two exporters' copies of one tied tensor must be identical, byte for byte."""
    if a.dtype != b.dtype or a.shape != b.shape:
        detail = f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    elif torch.equal(_bytes(a), _bytes(b)):
        return
    else:
        detail = "same shape and dtype, different values"
    raise TiedWeightsError(
        f"{dropped!r} and {kept!r} are one tied weight quantized twice, but the two copies "
        f"differ ({detail}); written once, one module would get the other's weights. Quantize "
        "both tied modules with the same recipe, or untie the weights."
    )


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)
