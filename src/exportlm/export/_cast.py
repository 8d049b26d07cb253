"""A copy of a model with its float tensors in another dtype, for targets that take ``dtype=``."""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["cast_copy"]

#: The dtypes a cast touches: plain floats. FP8 and integer tensors (quantized weights and
#: their codes) keep theirs, as ``nn.Module.to(dtype)`` would not (it casts FP8 too).
_CASTABLE = frozenset({torch.float32, torch.float16, torch.bfloat16})


def cast_copy(model: Any, dtype: torch.dtype) -> Any:
    """``model`` itself when every plain float tensor already is ``dtype``, else a deep copy
    whose float32 / float16 / bfloat16 parameters and buffers are cast to it (its
    ``config.dtype`` too, where it has one). The model is never changed."""
    tensors = [*model.parameters(), *model.buffers()]
    if all(t.dtype == dtype for t in tensors if t.dtype in _CASTABLE):
        return model
    copied = copy.deepcopy(model)
    copied._apply(lambda t: t.to(dtype) if t.dtype in _CASTABLE else t)
    config = getattr(copied, "config", None)
    if config is not None and hasattr(config, "dtype"):
        config.dtype = dtype
    return copied
