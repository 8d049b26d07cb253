"""Data-parallel calibration: ``torchrun --nproc-per-node 2 -m exportlm export`` on CPU (gloo).

Each rank calibrates on every second batch, the activation amax are all-reduced with
MAX and rank 0 writes: the checkpoint's tensors are byte-identical to a single-process
export on the same data. The comparison is exact on purpose: a maximum is exact in any
order, and every process runs one thread (``OMP_NUM_THREADS=1``, what torchrun sets) so
each batch's forward computes the same values in either run.
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


def _export(out: Path, calib: Path, recipe: str, ranks: int) -> subprocess.CompletedProcess[str]:
    launcher: list[str] = []
    if ranks > 1:
        launcher = ["-m", "torch.distributed.run", f"--nproc-per-node={ranks}"]
        launcher += ["--master-addr=127.0.0.1", f"--master-port={_free_port()}"]
    argv = [sys.executable, *launcher, "-m", "exportlm", "export", "--target", "hf_checkpoint"]
    argv += ["--model", "llama", "--quantize", recipe, "--calib-data", str(calib)]
    argv += ["--calib-seq-len", "16", "--calib-batch-size", "2", "--out", str(out)]
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


def test_two_ranks_write_the_single_process_fp8_checkpoint_byte_for_byte(
    tmp_path: Path, calib: Path
) -> None:
    recipe = "fp8+fp8_kv"
    single = _export(tmp_path / "single", calib, recipe, 1)
    assert single.returncode == 0, single.stderr
    parallel = _export(tmp_path / "dp", calib, recipe, 2)
    assert parallel.returncode == 0, parallel.stderr
    # Each rank calibrated its share, and only rank 0 wrote.
    assert "rank 1: calibrated; rank 0 writes" in parallel.stderr
    assert parallel.stdout.count("exported llama") == 1
    tensors = sorted(p.name for p in (tmp_path / "single").glob("*.safetensors"))
    assert tensors
    assert sorted(p.name for p in (tmp_path / "dp").glob("*.safetensors")) == tensors
    for name in [*tensors, "hf_quant_config.json", "config.json"]:
        assert (tmp_path / "dp" / name).read_bytes() == (tmp_path / "single" / name).read_bytes()


def test_awq_is_refused_under_two_ranks_naming_what_runs(tmp_path: Path, calib: Path) -> None:
    result = _export(tmp_path / "dp", calib, "int4_awq:group_size=32", 2)
    assert result.returncode != 0
    assert "cannot calibrate under a torch.distributed process group of 2 ranks" in result.stderr
    assert "Supported there: max-calibrated recipes (fp8" in result.stderr
    assert not (tmp_path / "dp").exists()


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
