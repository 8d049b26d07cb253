"""Model inputs shared by export, quantization and runtimes: validation, and deterministic
``input_ids`` from a model's vocabulary (no dependency on any export target)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from exportlm.errors import InvalidInputError, InvalidModelError

__all__ = ["VERIFY_IDS_SEED", "infer_vocab_size", "make_input_ids", "resolve_example_inputs"]

DEFAULT_BATCH = 2
DEFAULT_SEQ = 8
#: Added to a model's seed to draw the ids its logits are compared on: by the
#: conformance checks and by ``exportlm export --verify`` alike, so a check's printed
#: command compares on the same ids.
VERIFY_IDS_SEED = 1


def infer_vocab_size(model: nn.Module) -> int:
    """The vocabulary size from ``model.config.vocab_size`` or its first ``nn.Embedding``."""
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and vocab > 0:
        return vocab
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return int(module.num_embeddings)
    raise InvalidModelError(
        f"cannot infer the vocabulary size of {type(model).__name__}: it has no "
        "config.vocab_size and no nn.Embedding; pass example_inputs=<input_ids tensor>"
    )


def make_input_ids(
    vocab_size: int,
    batch: int = DEFAULT_BATCH,
    seq: int = DEFAULT_SEQ,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Deterministic ``input_ids`` [batch, seq] (int64), identical on every torch version and device.

    Drawn from numpy's PCG64, so the same seed gives the same ids everywhere.
    """
    rng = np.random.Generator(np.random.PCG64(seed))
    ids = rng.integers(0, vocab_size, size=(batch, seq), dtype=np.int64)
    return torch.from_numpy(ids).to(device)


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def resolve_example_inputs(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    batch: int = DEFAULT_BATCH,
    seq: int = DEFAULT_SEQ,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Normalize ``example_inputs`` to a tuple of tensors whose first is integer ``input_ids``.

    ``None`` builds deterministic ids from the model's vocabulary on the model's device
    (``vocab_size`` when the caller knows it already, else :func:`infer_vocab_size`).
    """
    if example_inputs is None:
        vocab = vocab_size if vocab_size is not None else infer_vocab_size(model)
        ids = make_input_ids(vocab, batch, seq, device=_model_device(model))
        return (ids,)
    inputs = (
        tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    )
    if not inputs:
        raise InvalidInputError(
            "example_inputs is empty; expected an input_ids tensor [batch, seq]"
        )
    ids = inputs[0]
    if not isinstance(ids, torch.Tensor):
        raise InvalidInputError(
            f"example_inputs must be an input_ids tensor or a tuple of tensors, got {type(ids).__name__}"
        )
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise InvalidInputError(
            f"input_ids must be an integer tensor (torch.long), got {ids.dtype}; "
            "token ids index the embedding table"
        )
    if ids.dim() != 2:
        raise InvalidInputError(f"input_ids must be 2-D [batch, seq], got shape {tuple(ids.shape)}")
    return (ids.long(), *inputs[1:])
