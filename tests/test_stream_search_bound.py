"""The stream's bound counts one calibration matrix per input, and the stream stays within it.

AWQ keeps one Gram matrix per group of linears that read one input, GPTQ one Hessian per
input shared by its readers (``q/k/v``; ``gate/up``): a Llama layer holds four ``in x in``
float64 matrices, not seven. The bound used to count one per linear, and for AWQ the
transient of the widest linear (``down_proj``) too, which keeps no Gram matrix; it now
finds the groups by one forward of the ``meta`` model (``stream/_shared_inputs.py``), and
counts the calibration matrices beside a decoder layer, not on top of the ``lm_head`` they
never coincide with. Each export runs under the smallest budget the bound accepts, in a
child process that reports its peak RSS (``VmHWM``) beyond the baseline the stream
measured; what it grew beyond the same stream without a recipe stays within what its
bound counts beyond that stream's (a process grows by imports and first-use buffers that
no term counts: 29 MB here, a few percent of a real model's bound). The tree before this
change refused those budgets (``LayerTooLargeError``: it asked 85 MB for either, against 62 and 60 MB now).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from exportlm.errors import LayerTooLargeError
from exportlm.stream import export_streaming
from tests._stream_models import llama_directory

_CHILD = r"""
import io, json, logging, re, sys
from exportlm.stream import export_streaming

log = io.StringIO()
logger = logging.getLogger("exportlm")
logger.addHandler(logging.StreamHandler(log))
logger.setLevel(logging.INFO)
recipe = None if sys.argv[3] == "none" else sys.argv[3]
# LAPACK's first-use buffers, taken before the stream measures its baseline: GPTQ's
# factorizations at the layer's width (1024), run once on an identity. They depend on the
# machine's LAPACK kernels (measured: 8-12 MB on an AMD EPYC, 29 MB on an Intel Xeon with AMX)
import torch
factor, _ = torch.linalg.cholesky_ex(torch.eye(1024) * 2)
torch.linalg.cholesky_ex(torch.cholesky_inverse(factor), upper=True)
del factor
export_streaming(sys.argv[1], sys.argv[2], recipe=recipe, max_memory=sys.argv[4],
                 max_shard_size="1MB")
found = re.search(r"memory bound of (\d+) MB = baseline (\d+) MB .* activations (\d+) MB",
                  log.getvalue())
with open("/proc/self/status", encoding="ascii") as status:
    peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) * 1024
bound, baseline, activations = (int(g) for g in found.groups())
print(json.dumps({"grown": peak / 1e6 - baseline, "held": bound - baseline - activations}))
"""
#: hidden = intermediate: every linear of the layer reads a 1024-wide input, so each of
#: its four inputs has a matrix (8.4 MB in float64), AWQ's ``down_proj`` included
_SHAPE = {"hidden_size": 1024, "intermediate_size": 1024, "num_attention_heads": 8}
#: Memory the process takes once, on its first use, that no term of the bound counts and
#: the child does not take before its baseline (LAPACK's buffers it does: ``_CHILD``)
_FIRST_USE_MB = 16


def _stream(src: Path, out: Path, recipe: str, budget: str) -> dict[str, float]:
    """What a child's stream grew beyond its baseline (peak RSS, ``VmHWM``) and held in its
    bound (the terms but the baseline and the activations), in MB."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src), str(out), recipe, budget],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama_directory(tmp_path_factory.mktemp("llama"), tied=False, layers=1, **_SHAPE)


@pytest.fixture(scope="module")
def recipe_less(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    """The same stream without a recipe: the process's own growth that no term counts
    (imports and buffers of the first forward, the allocator), measured."""
    return _stream(model, tmp_path_factory.mktemp("plain") / "out", "none", "1GB")


def _smallest_budget(src: Path, out: Path, recipe: str) -> int:
    """The smallest budget the stream accepts, in MB (from its refusal of a tiny one)."""
    with pytest.raises(LayerTooLargeError) as refused:
        export_streaming(src, out, recipe=recipe, max_memory="1KB", max_shard_size="1MB")
    need = re.search(r"expected at least ([\d.]+) MB", str(refused.value))
    assert need is not None, str(refused.value)
    return math.floor(float(need[1])) + 1  # the figure is rounded to 0.01 MB


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/status and glibc's allocator")
@pytest.mark.parametrize(
    ("recipe", "old_need", "clip"), [("int4_gptq", 85, 0), ("int4_awq", 85, 5)]
)
def test_the_stream_calibrates_within_the_smallest_budget_its_bound_accepts(
    model: Path,
    recipe_less: dict[str, float],
    tmp_path: Path,
    recipe: str,
    old_need: int,
    clip: int,
) -> None:
    budget = _smallest_budget(model, tmp_path / "refused", recipe)
    # one matrix per input (4 x 8.4 MB, and one forward's transient), not one per linear
    # (7 x 8.4 MB): the tree before refused every budget below old_need MB. AWQ's clip
    # search adds its blocks of X^T X, one per input: 4 x 1024 x 128 x 8 B = 4.2 MB
    assert budget < old_need - 20 + clip, budget
    found = _stream(model, tmp_path / "out", recipe, f"{budget}MB")
    # what calibrating adds to the recipe-less stream stays within what the bound adds
    added, counted = (found[k] - recipe_less[k] for k in ("grown", "held"))
    assert added <= counted + _FIRST_USE_MB, (found, recipe_less, budget)
