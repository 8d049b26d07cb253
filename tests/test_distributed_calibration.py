"""Data-parallel calibration: ``torchrun --nproc-per-node 2 -m exportlm export`` on CPU (gloo).

Each rank calibrates on every second batch, the statistics are combined over the ranks
(amax: MAX; AWQ's sums and Gram matrices: float64 SUM in rank order; SmoothQuant's
ranges: MIN / MAX) and rank 0 writes: the checkpoint's tensors are byte-identical to a
single-process export on the same data. The comparison is exact on purpose: a maximum is
exact in any order, a float64 sum of float32 values is exact, and the AWQ search's
decisions are far from the Gram sums' ~1e-16 rounding; every process runs one thread
(``OMP_NUM_THREADS=1``, what torchrun sets) so each batch's forward computes the same
values in either run.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    paths = [str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _export(
    out: Path, calib: Path, recipe: str, ranks: int, *extra: str, model: str = "llama"
) -> subprocess.CompletedProcess[str]:
    launcher: list[str] = []
    if ranks > 1:
        launcher = ["-m", "torch.distributed.run", f"--nproc-per-node={ranks}"]
        launcher += ["--master-addr=127.0.0.1", f"--master-port={_free_port()}"]
    argv = [sys.executable, *launcher, "-m", "exportlm", "export", "--target", "hf_checkpoint"]
    argv += ["--model", model, "--quantize", recipe, "--calib-data", str(calib)]
    argv += ["--calib-seq-len", "16", "--calib-batch-size", "2", "--out", str(out), *extra]
    return subprocess.run(
        argv, env=_env(), capture_output=True, text=True, timeout=240, check=False
    )


@pytest.fixture(scope="module")
def calib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "quick", "brown", "fox", "Zebra!"]
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(
        "\n".join(" ".join(rng.choice(words) for _ in range(40)) for _ in range(12)),
        encoding="utf-8",
    )
    return path


def _single_and_parallel(
    tmp_path: Path, calib: Path, recipe: str, model: str = "llama"
) -> tuple[Path, Path, str]:
    single = _export(tmp_path / "single", calib, recipe, 1, model=model)
    assert single.returncode == 0, single.stderr
    parallel = _export(tmp_path / "dp", calib, recipe, 2, model=model)
    assert parallel.returncode == 0, parallel.stderr
    # Each rank calibrated its share, and only rank 0 wrote.
    assert "rank 1: calibrated; rank 0 writes" in parallel.stderr
    assert parallel.stdout.count(f"exported {model}") == 1
    return tmp_path / "single", tmp_path / "dp", parallel.stderr


def _assert_same_files(single: Path, dp: Path, configs: tuple[str, ...]) -> None:
    tensors = sorted(p.name for p in single.glob("*.safetensors"))
    assert tensors
    assert sorted(p.name for p in dp.glob("*.safetensors")) == tensors
    for name in [*tensors, *configs]:
        assert (dp / name).read_bytes() == (single / name).read_bytes(), name


def test_two_ranks_write_the_single_process_fp8_checkpoint_byte_for_byte(
    tmp_path: Path, calib: Path
) -> None:
    single, dp, _ = _single_and_parallel(tmp_path, calib, "fp8+fp8_kv")
    _assert_same_files(single, dp, ("hf_quant_config.json", "config.json"))


@pytest.mark.parametrize("model", ["llama", "qwen3_moe"])
def test_two_ranks_write_the_single_process_awq_checkpoint_byte_for_byte(
    tmp_path: Path, calib: Path, model: str
) -> None:
    """AWQ under two ranks: the ``mean(|x|)`` sums (float64, exact), the search's Gram
    matrices (float64, ~1e-16 relative apart from one process's) and losses are summed
    over the ranks, so every rank picks one process's scales and clip ratios (the clip's
    Gram blocks summed too, per expert for stacked experts); the bytes are the same (every
    decision of this search is decided by far more than the sums' rounding)."""
    single, dp, _ = _single_and_parallel(tmp_path, calib, "int4_awq:group_size=32", model)
    _assert_same_files(single, dp, ("hf_quant_config.json", "config.json"))


@pytest.mark.parametrize(
    ("recipe", "layout"), [("int8_sq", "modelopt"), ("w8a8", "compressed-tensors")]
)
def test_two_ranks_write_the_single_process_smoothquant_checkpoint_byte_for_byte(
    tmp_path: Path, calib: Path, recipe: str, layout: str
) -> None:
    """SmoothQuant's statistics are maxima and minima (per-channel amax, input ranges):
    exact in any order, so the two ranks' checkpoint is one process's, bit for bit."""
    single = _export(tmp_path / "single", calib, recipe, 1, "-o", f"format={layout}")
    assert single.returncode == 0, single.stderr
    parallel = _export(tmp_path / "dp", calib, recipe, 2, "-o", f"format={layout}")
    assert parallel.returncode == 0, parallel.stderr
    assert "rank 1: calibrated; rank 0 writes" in parallel.stderr
    _assert_same_files(tmp_path / "single", tmp_path / "dp", ("config.json",))


_LIBRARY_RUN = """
import copy, json, sys
import torch
import torch.distributed as dist
from torch import nn
from exportlm.calibration import calibrate_with
from exportlm.quant import quantize

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(256, 32), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
batches = [torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(i)) for i in
           range(int(sys.argv[2]))]
calibrated = lambda m: {n: b.tolist() for n, b in m.named_buffers() if n.endswith("amax")}
alone = calibrated(quantize(copy.deepcopy(model), "fp8", calibrate_with(batches)))
dist.init_process_group("gloo")
seen = []
model[1].register_forward_pre_hook(lambda m, a: seen.append(1))
together = calibrated(quantize(model, "fp8", calibrate_with(batches)))
out = {"alone": alone, "together": together, "forwards": len(seen)}
with open(f"{sys.argv[1]}.{dist.get_rank()}.json", "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("batches", [5, 1])
def test_quantize_under_a_callers_group_takes_the_max_over_ranks(
    tmp_path: Path, batches: int
) -> None:
    """The library path: ``quantize(model, "fp8", calibrate_with(batches))`` under a group
    the caller initialised; with one batch, rank 1 calibrates nothing and gets rank 0's amax."""
    script = tmp_path / "run.py"
    script.write_text(_LIBRARY_RUN, encoding="utf-8")
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    argv += ["--master-addr=127.0.0.1", f"--master-port={_free_port()}"]
    argv += [str(script), str(tmp_path / "out"), str(batches)]
    result = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    ranks = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in (0, 1)]
    # rank r ran batches r, r + 2, ...: every batch once over the two ranks
    assert [r["forwards"] for r in ranks] == [(batches + 1) // 2, batches // 2]
    for rank in ranks:
        assert rank["together"] == rank["alone"]
        assert rank["together"]
