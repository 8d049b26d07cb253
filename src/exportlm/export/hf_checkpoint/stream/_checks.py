"""What streams and what does not yet, and whether one layer fits the budget.

Both are checked before anything is read or written, so a refusal costs a second.
"""

from __future__ import annotations

from torch import nn

from exportlm.errors import LayerTooLargeError, StreamingUnsupportedError
from exportlm.export.hf_checkpoint.stream._memory import MemoryBound
from exportlm.quant import QuantRecipe

__all__ = ["check_fits", "check_streamable"]

_IN_MEMORY = "export it in memory instead (drop --stream / --max-memory, or export_model)"


def check_streamable(
    model: nn.Module, recipe: QuantRecipe | None, reads_names: bool, layers: str
) -> None:
    """Refuse what does not stream yet, naming it.

    ``layers`` is the name of the decoder layers' list (``model.layers``): the stream
    quantizes the modules inside it, one layer at a time, and writes the modules around
    it (embedding, final norm, ``lm_head``) as they are.

    Raises:
        StreamingUnsupportedError: a checkpoint whose names transformers converts on
            load other than by fusing per-expert tensors, or a recipe that would quantize
            a module outside the decoder layers.

    Every registered format streams, a plugin's too: a ``FormatSpec`` supplies
    per-tensor ``quantize`` / ``dequantize`` functions and declares which of exportlm's
    own calibrations its recipe uses (amax, AWQ search, SmoothQuant, KV-cache scales),
    and each of those reads and folds only the modules of one decoder layer.
    """
    if not reads_names:
        raise StreamingUnsupportedError(
            f"{type(model).__name__} converts its checkpoint's tensor names on load in a way "
            "the stream does not read; only models saved under their module names, or whose "
            "only conversion fuses per-expert tensors into 3-D experts (Mixtral, Qwen2-MoE, "
            f"Qwen3-MoE), stream yet; {_IN_MEMORY}"
        )
    if recipe is None:
        return
    outside = _quantized_outside(model, recipe, layers + ".")
    if outside:
        raise StreamingUnsupportedError(
            f"the recipe quantizes {', '.join(outside)}, outside the decoder layers "
            f"({layers}.*); the stream quantizes only inside them and writes the modules "
            f"around them unquantized; leave those modules out of the recipe, or {_IN_MEMORY}"
        )


def _quantized_outside(model: nn.Module, recipe: QuantRecipe, inside: str) -> list[str]:
    """The linears and embeddings outside ``inside`` that ``recipe`` would quantize in memory."""
    found = []
    for name, module in model.named_modules():
        if name.startswith(inside) or not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        embedding = isinstance(module, nn.Embedding)
        if recipe.algo_for(name, default_applies=not embedding) is not None:
            found.append(name)
    return found


def check_fits(budget: int | None, bound: MemoryBound, what: str) -> None:
    """Refuse a budget below what the stream holds beyond the process itself, its output
    shard sized to the budget (:func:`~exportlm.export.hf_checkpoint.stream._budget.shard_size_within`).

    That is the bound's terms but the baseline: the largest set of modules loaded at
    once (``what`` names it), one output shard and, with a recipe, quantizing one
    linear and what a calibrating layer's matrices add to that set. The calibration activations are not counted: what does not fit the rest
    of the budget is kept on disk.

    Raises:
        LayerTooLargeError: with the figures and what to do.
    """
    if budget is None:
        return
    need = bound.held
    if need > budget:
        raise LayerTooLargeError(
            f"streaming needs about {_size(need)} beyond the process itself ({what} "
            f"{_size(bound.modules)}, one output shard {_size(bound.shard)}, quantizing one "
            f"linear {_size(bound.working)}, calibration matrices {_size(bound.search)} "
            f"held beside a decoder layer: {_size(bound.beside_modules)} more), more than "
            f"the budget of {_size(budget)}; expected "
            f"at least {_size(need)} (the output shard is already its largest tensor alone). "
            "Raise --max-memory"
        )


def _size(n: int) -> str:
    """``n`` bytes in words: ``--max-memory 1KB`` read "the 0.00 MB budget"."""
    if n >= 10**9:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.2f} MB" if n >= 10**4 else f"{n} bytes"
