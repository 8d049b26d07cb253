"""The one verifier of logits roundtrips: an artifact's runtime against the eager model.

``exportlm export --verify``, :func:`exportlm.export.verify_onnx` and the conformance
checks (``roundtrip_logits``, ``dynamic_shapes``, ``cache_wrapper``, ``deterministic``,
``roundtrip_quantized``, ``roundtrip_generated``, ``generation_parity``) all compare
through this module, so "the inputs of a roundtrip", "the eager reference" and "within
tolerance" mean one thing, and the constants they use are stated once, here:

* :data:`TRACED_SHAPE` and :data:`IDS_SEED`: the shape every built-in target traces
  with and the seed offset of a roundtrip's ids (not the traced ids, which use seed 0);
* :class:`Tolerance`: ``|actual - expected| <= atol + rtol * |expected|`` elementwise,
  NaN / inf always failing (:func:`~exportlm.export.compare_logits`), from a target's
  declaration (:meth:`Tolerance.of`), :data:`EXACT` for two runs of one artifact, and
  :data:`FLIP` for a model whose activations are quantized (one activation rounding the
  other way at an FP8 midpoint; measured in ``roundtrip_quantized``'s docstring).

:func:`verify_roundtrip` draws nothing itself: the caller passes the ``input_ids``
(:func:`roundtrip_ids`), so ``verify_onnx`` can compare on a user's inputs. Every
step that runs code under test goes through ``call(what, fn, *args)``; the checks pass
their ``attempt`` (a failure naming ``what``), everyone else calls directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from exportlm.errors import InvalidInputError, RuntimeOutputError
from exportlm.export._compare import LogitsComparison, compare_logits
from exportlm.export._wrapper import ExportCacheWrapper
from exportlm.inputs import VERIFY_IDS_SEED, infer_vocab_size, make_input_ids

if TYPE_CHECKING:
    import torch
    from torch import nn

    from exportlm.export.declaration import TargetInfo

__all__ = [
    "EXACT",
    "FLIP",
    "IDS_SEED",
    "TRACED_SHAPE",
    "Tolerance",
    "compare_within",
    "eager_logits",
    "roundtrip_ids",
    "runtime_logits",
    "verify_roundtrip",
]

_T = TypeVar("_T")
#: ``(batch, seq)`` of the example inputs every built-in target traces with.
TRACED_SHAPE = (2, 8)
#: Seed offset of a roundtrip's ``input_ids`` (added to the model's seed).
IDS_SEED = VERIFY_IDS_SEED


@dataclass(frozen=True)
class Tolerance:
    """How far an artifact's logits may be from the reference's, elementwise."""

    atol: float
    rtol: float

    @classmethod
    def of(cls, info: TargetInfo, scale: float = 1.0) -> Tolerance:
        """A target's declared ``atol`` / ``rtol``, times ``scale`` (a family's
        ``tolerance_scale``, e.g. a user's model directory)."""
        return cls(info.atol * scale, info.rtol * scale)


#: Two runs of the same artifact on the same inputs: bit-identical.
EXACT = Tolerance(0.0, 0.0)
#: Per input set when activations are quantized: 2.5x the largest FP8 rounding flip
#: measured on the toy models (7.8e-3 at logits of magnitude ~0.85).
FLIP = Tolerance(2e-2, 2e-2)


def _direct(what: str, fn: Callable[..., _T], *args: Any) -> _T:
    del what  # only the checks' ``attempt`` names the step
    return fn(*args)


Call = Callable[..., Any]


def roundtrip_ids(
    model: nn.Module, shape: tuple[int, int], *, seed: int, device: str = "cpu"
) -> torch.Tensor:
    """Deterministic ``input_ids [batch, seq]`` from the model's vocabulary (numpy PCG64).

    ``seed`` is the model's seed; :data:`IDS_SEED` is added here, so a roundtrip's ids are
    never the traced ones.
    """
    return make_input_ids(
        infer_vocab_size(model), shape[0], shape[1], seed=seed + IDS_SEED, device=device
    )


def eager_logits(model: nn.Module, ids: torch.Tensor, *, call: Call = _direct) -> torch.Tensor:
    """The reference: ``model`` under :class:`ExportCacheWrapper` (``use_cache=False``, logits)."""
    import torch

    with torch.no_grad():
        logits: torch.Tensor = call("running the eager model", ExportCacheWrapper(model), ids)
    return logits.detach()


def runtime_logits(
    runtime: Callable[[torch.Tensor], Any], ids: torch.Tensor, *, call: Call = _direct
) -> torch.Tensor:
    """The runtime's output on ``ids``, which must be one logits tensor (torch or numpy).

    Raises:
        RuntimeOutputError: it returned anything else (a tuple, a mapping).
    """
    import numpy as np
    import torch

    out = call(f"running the runtime on input_ids {list(ids.shape)}", runtime, ids)
    if isinstance(out, np.ndarray):
        return torch.from_numpy(out)
    if isinstance(out, torch.Tensor):
        return out.detach()
    raise RuntimeOutputError(
        f"the runtime returned {_describe(out)}; expected one logits tensor "
        "[batch, seq, vocab] (did the export trace the model without ExportCacheWrapper?)"
    )


def compare_within(actual: Any, expected: Any, tolerance: Tolerance) -> LogitsComparison:
    """``actual`` logits against ``expected`` within ``tolerance`` (the one comparison)."""
    return compare_logits(actual, expected, tolerance.atol, tolerance.rtol)


def verify_roundtrip(
    model: nn.Module | None,
    runtime: Callable[[torch.Tensor], Any],
    ids: torch.Tensor,
    tolerance: Tolerance,
    *,
    call: Call = _direct,
    expected: torch.Tensor | None = None,
) -> LogitsComparison:
    """The runtime's logits on ``ids`` against the eager ``model``'s, within ``tolerance``.

    ``expected``, when given, is the reference instead of ``model``'s logits (computed
    once by the caller, or another run of the artifact). The eager model runs first, then
    the runtime; never asserts: the comparison's ``passed`` says.

    Raises:
        RuntimeOutputError: the runtime returned something other than one logits tensor.
        InvalidInputError: neither ``model`` nor ``expected`` was given.
    """
    if expected is None:
        if model is None:
            raise InvalidInputError(
                "verify_roundtrip got neither the eager model nor the expected logits; "
                "pass the model the artifact was exported from, or expected=<its logits>"
            )
        expected = eager_logits(model, ids, call=call)
    actual = runtime_logits(runtime, ids, call=call)
    return compare_within(actual, expected, tolerance)


def _describe(value: Any) -> str:
    from collections.abc import Mapping

    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} items"
    if isinstance(value, Mapping):
        return f"a mapping with keys {sorted(map(str, value))}"
    return f"a {type(value).__name__}"
