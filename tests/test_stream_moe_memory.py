"""A streamed MoE layer peaks within what a dense layer of the same size does.

Each export runs in a child process of its own, which reports its peak RSS (its
``VmHWM``: ``ru_maxrss`` survives ``exec`` and would start at the RSS of the test process
that forked it) and the terms of the bound the stream logged; the test compares what each
held beyond its own baseline (the process before its first weight), in units of its
decoder layer. The two models have one decoder layer of the same size (102 MB in bf16):
eight experts of intermediate 4096, or one MLP of intermediate 32768, at hidden 512.
Before the experts were fake-quantized and calibrated one expert at a time, the MoE
layer's forward held the layer's whole fake-quantized expert stack (and its ``|x|`` while
calibrating) beside the layer: 2.36 layers beyond the baseline, against 1.55 for the dense
layer (1.57 since). Under INT4 AWQ the MoE layer's calibration and export divided the
whole stack by the experts' AWQ scales before taking each expert's amax and codes: 2.40
layers, against 1.75 one expert at a time (and 1.93 or 3.25 for the dense layer, whose
32768-wide ``down_proj`` the AWQ search holds in float32). CI's machine measured the MoE
layer at 2.02: the INT4 bound is taken against the same model's FP8 stream on the same
machine, and ``tests/test_experts.py`` checks without a clock or an allocator that no
projection's whole stack is divided at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_HIDDEN = 512
_CHILD = r"""
import io, json, logging, re, sys
from exportlm.stream import export_streaming

log = io.StringIO()
logger = logging.getLogger("exportlm")
logger.addHandler(logging.StreamHandler(log))
logger.setLevel(logging.INFO)
export_streaming(sys.argv[1], sys.argv[2], recipe=sys.argv[3], max_shard_size="2MB")
found = re.search(r"baseline (\d+) MB .* largest module set (\d+) MB", log.getvalue())
# this process's own high-water mark: ru_maxrss would keep the parent's RSS at the fork
with open("/proc/self/status", encoding="ascii") as status:
    peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) * 1024
print(json.dumps({"peak": peak / 1e6, "baseline": int(found[1]), "layer": int(found[2])}))
"""


def _save(directory: Path, kind: str) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    common = {
        "vocab_size": 256,
        "hidden_size": _HIDDEN,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    torch.manual_seed(0)
    if kind == "moe":  # experts: 8 x 3 x 4096 x 512 = 50M parameters
        config = MixtralConfig(intermediate_size=4096, num_local_experts=8, **common)
        model = MixtralForCausalLM(config)
    else:  # the same in one MLP: 3 x 32768 x 512
        model = LlamaForCausalLM(LlamaConfig(intermediate_size=32768, **common))
    model.to(torch.bfloat16).save_pretrained(directory / kind, max_shard_size="20MB")
    return directory / kind


def _held_beyond_baseline(src: Path, out: Path, recipe: str = "fp8") -> tuple[float, int]:
    """(peak RSS - baseline) in layers of the child's ``recipe`` export of ``src``, and its
    layer in MB."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src), str(out), recipe],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return (found["peak"] - found["baseline"]) / found["layer"], found["layer"]


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/status and glibc's allocator")
def test_a_streamed_moe_layer_holds_no_more_than_a_dense_layer_of_its_size(
    tmp_path: Path,
) -> None:
    moe, moe_layer = _held_beyond_baseline(_save(tmp_path, "moe"), tmp_path / "moe-out")
    dense, dense_layer = _held_beyond_baseline(_save(tmp_path, "dense"), tmp_path / "dense-out")
    assert moe_layer == dense_layer == 102  # the bound's largest module set: the layer
    # measured: MoE 1.57 layers, dense 1.55 (2.36 for MoE with the whole stack at once);
    # a quarter of a layer (25 MB) is left for the allocator and the other jobs
    assert moe <= dense + 0.25, f"MoE held {moe:.2f} layers beyond its baseline, dense {dense:.2f}"
    assert dense <= 2.0  # the layer, one linear's float32 working memory, the 2 MB shard


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/status and glibc's allocator")
def test_a_streamed_moe_layer_under_int4_awq_holds_no_more_than_a_dense_layer(
    tmp_path: Path,
) -> None:
    moe_src = _save(tmp_path, "moe")
    moe, _ = _held_beyond_baseline(moe_src, tmp_path / "moe-out", "int4_awq")
    dense, _ = _held_beyond_baseline(_save(tmp_path, "dense"), tmp_path / "dense-out", "int4_awq")
    # measured: MoE 1.70-1.79 layers (2.24-2.40 with each projection's whole stack divided by the
    # AWQ scales at once, in the weight amax and in the exporter), dense 1.93 or 3.25 (the AWQ
    # search's float32 copies of the 32768-wide down_proj, held or not by the time the peak
    # comes); CI's machine measured the MoE at 2.02
    assert moe <= dense + 0.25, f"MoE held {moe:.2f} layers beyond its baseline, dense {dense:.2f}"
    # beside the same model's FP8 stream, which holds the layer, one linear's float32 working
    # memory and the shard (1.48-1.55 here), the AWQ stream adds its per-expert search and the
    # packed codes: 0.15-0.24 of a layer here (clip=false: 1.61), and the clip search's
    # blocks of X^T X per expert, float64, 8 x (512 + 4096) x 128 x 8 B = 37.7 MB (0.37 of a
    # layer; measured 2.02 with them). Dividing a projection's whole stack at once adds 0.59
    # (2.24 against 1.65), and the clip writing a new stack beside the old one a layer (2.73);
    # what a machine adds to both streams (its kernels' workspaces, its allocator) cancels out
    fp8, _ = _held_beyond_baseline(moe_src, tmp_path / "moe-fp8-out", "fp8")
    clip_blocks = 8 * (_HIDDEN + 4096) * 128 * 8 / 102e6
    assert moe <= fp8 + 0.5 + clip_blocks, (
        f"MoE held {moe:.2f} layers beyond its baseline, {fp8:.2f} under FP8"
    )
