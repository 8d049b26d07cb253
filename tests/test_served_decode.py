"""``served`` checks every decode step, not only the chosen tokens (issue 42).

A test engine runs the real transformers worker in this interpreter, with a planted
decode-position bug: during decode only, a left-padded row's next position is its
column in the padded batch, not one past its own last position (what an adapter that
forgets the padding computes). The prefill and the teacher-forced scoring stay right,
so only the decode path is wrong, and the greedy tokens may well stay equal: on llama
they do (qwen3_moe flips one), so tokens and scores alone passed it on llama. The comparison of each decode step's logprobs with eager's fails it on every
family; the same worker without the bug passes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import exportlm
from exportlm.engines import (
    WORKERS_DIR,
    Engine,
    Outcome,
    Served,
    Support,
    Tolerance,
    serve_and_compare,
)
from exportlm.models import tiny_hf_model

TOL = Tolerance(1e-4, "float32 transformers, as stated for the real engine")
VERSION = __import__("transformers").__version__

#: The transformers worker, its decode positions swapped for the bug when BUG is set.
WORKER = f"""
import sys
sys.path.insert(0, {str(WORKERS_DIR)!r})
import _worker
import transformers_worker

BUG = {{bug}}
if BUG:
    def column_positions(pos, mask):
        import torch
        return torch.full_like(pos[:, -1:], mask.shape[-1])  # the padding counted
    transformers_worker.next_positions = column_positions

sys.exit(_worker.main("decodebug", "transformers", ("transformers",), transformers_worker.serve))
"""

FAMILIES = ["llama", "qwen3_moe"]


def _engine(tmp_path: Path, bug: bool) -> Engine:
    worker = tmp_path / f"decodebug_{bug}_worker.py"
    worker.write_text(WORKER.format(bug=bug))
    row = Support("hf_checkpoint", None, dtypes=("float32",), devices=("cpu",))
    return Engine(
        "decodebug",
        "transformers",
        ("transformers",),
        str(worker),
        table_version=VERSION,
        table=(row,),
    )


@pytest.fixture(scope="module", params=FAMILIES)
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, dict[bool, Served]]:
    family = str(request.param)
    tmp = tmp_path_factory.mktemp(family)
    model = tiny_hf_model(family, seed=0).eval()  # the default init, as served's float32 items
    out = exportlm.export_model("hf_checkpoint", model, tmp / "ckpt")
    with torch.no_grad():
        return family, {
            bug: serve_and_compare(
                _engine(tmp, bug), out, model, tolerance=TOL, python=sys.executable
            )
            for bug in (False, True)
        }


def test_the_worker_without_the_bug_passes_every_decode_step(
    served: tuple[str, dict[bool, Served]],
) -> None:
    good = served[1][False]
    assert good.outcome is Outcome.PASSED, good.message
    assert good.decode_gap is not None
    assert good.decode_gap <= TOL.atol
    assert "decode steps: max gap" in good.message


def test_a_decode_position_bug_fails_served_on_every_family(
    served: tuple[str, dict[bool, Served]],
) -> None:
    family, runs = served
    bad = runs[True]
    assert bad.outcome is Outcome.FAILED, bad.message
    if family == "llama":
        # llama keeps every greedy token: tokens and teacher-forced scores alone pass it
        assert bad.tokens_equal, bad.message
    # the bug is in decode only: the teacher-forced scores stay right
    assert bad.max_gap is not None
    assert bad.max_gap <= TOL.atol
    assert bad.decode_gap is not None
    assert bad.decode_gap > TOL.atol
    assert bad.decode_gap_at is not None
    _row, step = bad.decode_gap_at
    assert step > 0  # the prefill is right; a decode step is not
    assert "decode steps: max gap" in bad.message
