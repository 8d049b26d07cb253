"""torch's FakeTensor dispatch cache, switched off while ``torch.export`` traces a toy-sized model.

With symbolic batch and sequence a cache hit rebuilds its output by re-evaluating the
sizes' sympy expressions, which costs more than running the meta kernel again: it was
the largest single cost in a profile of ``torch.onnx.export`` (``torch.export`` plus the
decompositions). The traced graph is the same: the ops, their order and arguments
(node names may be numbered differently in a ``.pt2``; the ONNX node lists are identical).

Measured (torch 2.13 CPU, one thread, the 2-layer toy llama, 4 alternating exports in
one process, median CPU seconds, node lists compared):

=========================================  ===========  ============
export                                     cache on     cache off
=========================================  ===========  ============
``onnx``, ``kv_cache=True``                12.5 s       9.0 s
``onnx``, plain                            9.1 s        8.4 s
``torch_export``, ``kv_cache=True``        3.4 s        2.1 s
=========================================  ===========  ============

Used by the ``torch_export`` target and the ``onnx`` target's dynamo exporter (the
legacy TorchScript exporter does not trace with fake tensors). A torch without the
flag exports unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["fake_tensor_cache_off"]


def fake_tensor_cache_off() -> contextlib.AbstractContextManager[Any]:
    """A context in which torch's FakeTensor dispatch cache is off (restored on exit)."""
    import torch._dynamo.config as dynamo_config

    if not hasattr(dynamo_config, "fake_tensor_cache_enabled"):  # pragma: no cover
        return contextlib.nullcontext()
    patched: contextlib.AbstractContextManager[Any] = dynamo_config.patch(
        fake_tensor_cache_enabled=False
    )
    return patched
