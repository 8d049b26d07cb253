"""Optional dependencies: import them where they are used, or say which extra installs them."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

from exportlm.errors import MissingDependencyError

__all__ = ["is_transformers_model", "require_modules"]


def require_modules(*modules: str, extra: str, purpose: str) -> list[ModuleType]:
    """Import ``modules`` and return them, in order.

    Raises:
        MissingDependencyError: one or more of them cannot be imported; the error
            names every missing one, ``purpose`` and ``pip install 'exportlm[extra]'``,
            and chains the first ``ImportError``.
    """
    loaded: list[ModuleType] = []
    missing: list[str] = []
    first_error: ImportError | None = None
    for name in modules:
        try:
            loaded.append(importlib.import_module(name))
        except ImportError as err:
            missing.append(name)
            first_error = first_error or err
    if missing:
        raise MissingDependencyError(missing, extra, purpose) from first_error
    return loaded


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
