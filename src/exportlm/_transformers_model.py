"""Whether a model is a transformers ``PreTrainedModel``, asked without importing transformers.

Shared by the export targets (``exportlm.export``) and the model registry
(``exportlm.models``), which do not import each other.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["is_transformers_model"]


def is_transformers_model(model: Any) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel``, without importing transformers.

    No instance can exist before ``transformers.modeling_utils`` is imported, and reaching
    ``transformers.PreTrainedModel`` through the lazy top-level module would import it:
    1.4-1.8 s (modeling utilities, masking, ``torch.distributed.tensor``) in a process that
    exports a model of its own to ONNX and never needed transformers.
    """
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    base = getattr(modeling_utils, "PreTrainedModel", None)
    return isinstance(base, type) and isinstance(model, base)
