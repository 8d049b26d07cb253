"""``exportlm export --verify``: the artifact's logits against the eager model's.

Through the one verifier (:func:`exportlm.export.roundtrip.verify_roundtrip`), with the
target's declared tolerance and the ids the conformance checks draw (seed ``--seed`` +
``IDS_SEED``, default shape the traced one), so a check's printed command reproduces its
comparison. A runtime that returns anything but one logits tensor raises
:class:`~exportlm.errors.RuntimeOutputError` naming what it returned (exit 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from exportlm._progress import phase

if TYPE_CHECKING:
    from exportlm.cli._export import ExportPlan

__all__ = ["verify_export"]


def verify_export(plan: ExportPlan, model: Any, path: Path) -> Any:
    """The comparison at each ``--verify-shape`` (a :class:`~exportlm.export.LogitsComparison`).

    The first shape that differs decides (a failing comparison); else the last.
    """
    from exportlm.export import get_target_info, load_exported
    from exportlm.export.roundtrip import TRACED_SHAPE, Tolerance, roundtrip_ids, verify_roundtrip

    info = get_target_info(plan.target)
    model = _reference(plan, model).eval()  # the eager view every target exports
    result = None
    with phase(f"verifying in the {info.runtime} runtime"):
        runtime = load_exported(plan.target, path, trust=plan.trust)
        for shape in plan.verify_shapes or (TRACED_SHAPE,):
            ids = roundtrip_ids(model, shape, seed=plan.seed)
            result = verify_roundtrip(model, runtime, ids, Tolerance.of(info))
            if not result.passed:
                break
    return result


def _reference(plan: ExportPlan, model: Any) -> Any:
    """The eager model as the artifact computes: in the dtype a ``dtype`` option cast it to.

    ``-o dtype=fp32`` of a bfloat16 directory writes a float32 artifact; against the
    bfloat16 model its logits differ by bfloat16's rounding, not by a fault.
    """
    wanted = plan.options.get("dtype")
    if wanted is None:
        return model
    from exportlm.export._cast import cast_copy
    from exportlm.export.options import resolve_dtype

    return cast_copy(model, resolve_dtype(wanted, where=f"{plan.target} dtype"))
