"""``benchmarks/quality.py``: its texts and its table (the benchmark itself runs for an hour).

* The calibration text is cut so that its first N lines are exactly N calibration rows
  of 512 tokens for the real model's tokenizer: the same rows, with no short last row,
  for exportlm's CLI and for the peers (``benchmarks/data/README.md``).
* The evaluation text is never the calibration text.
* ``--markdown RESULTS`` writes a peer without the scheme as "—", a failed cell as its
  error, and flags a recipe where ours is more than 1% worse than the better peer.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from exportlm.calibration import calibration_batches, load_calibration_texts
from exportlm.calibration._tokenizer import load_local_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data"


@pytest.mark.real_model
@pytest.mark.parametrize("samples", [1, 5, 32])
def test_n_calibration_lines_are_n_rows_of_512_tokens(real_model_dir: Path, samples: int) -> None:
    tokenizer = load_local_tokenizer(real_model_dir)
    texts = load_calibration_texts(DATA / "calibration.txt", samples)
    batches = calibration_batches(texts, tokenizer, tokenizer.vocab_size, seq_len=512)
    assert [tuple(b.shape) for b in batches] == [
        (min(8, samples - start), 512) for start in range(0, samples, 8)
    ]


def test_the_evaluation_text_is_not_the_calibration_text() -> None:
    evaluation = DATA.joinpath("eval.txt").read_text(encoding="utf-8")
    calibration = DATA.joinpath("calibration.txt").read_text(encoding="utf-8")
    words = evaluation.split()
    shingles = {" ".join(words[i : i + 8]) for i in range(len(words) - 8)}
    assert not any(s in calibration for s in shingles)
    assert len(calibration.splitlines()) >= 128  # the memory row's 128 samples


#: A results file's meta for the report tests (no memory row).
META = {
    "bf16": {"ppl": 19.0, "agree": 1.0},
    "calibration": {"rows": 4, "tokens": 2048},
    "seq_len": 512,
    "eval_tokens": 1024,
    "started": "2026-12-05 09:00 UTC",
    "wall_s": 600.0,
}


def _markdown(tmp_path: Path, results: dict[str, object]) -> list[str]:
    """The lines ``quality.py --markdown`` prints for ``results``."""
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--markdown", str(path)],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    return done.stdout.splitlines()


def _benchmark_module(name: str) -> ModuleType:
    """``benchmarks/NAME.py`` imported from its file (the benchmarks are no package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(recipe: str, producer: str, **fields: object) -> dict[str, object]:
    return {"recipe": recipe, "producer": producer, "memory_row": False, **fields}


def test_the_markdown_table_shows_absent_failed_and_worse_cells(tmp_path: Path) -> None:
    measured = {"ppl": 20.0, "agree": 0.9, "eval_s": 1.0}
    results = {
        "meta": {**META, "memory_samples": 128, "memory_seq_len": 512},
        "rows": [
            _row("w8a8", "exportlm", mem=measured, ckpt=measured, export_s=10.0, peak_rss=1e9),
            _row("w8a8", "modelopt", absent=True),
            _row(
                "w8a8", "llmcompressor", mem={**measured, "ppl": 19.5}, export_s=9.0, peak_rss=2e9
            ),
            _row("nvfp4", "exportlm", error="exit 1: ValueError: no scheme"),
            {**_row("fp8", "exportlm", export_s=30.0, peak_rss=1.5e9), "memory_row": True},
        ],
    }
    lines = _markdown(tmp_path, results)
    assert "| w8a8 | ModelOpt | — | — | — | — | — | — |" in lines
    assert (
        "| nvfp4 | exportlm | error: exit 1: ValueError: no scheme | — | — | — | — | — |" in lines
    )
    assert "| exportlm | 30 | 1.50 |  |" in lines
    assert any(line.startswith("- `w8a8`") and "WORSE by more than 1%" in line for line in lines)
    assert not any("--float32-matmuls" in line for line in lines)
    results["meta"]["float32_matmuls"] = True  # a run that forced them says so
    assert any("(`--float32-matmuls`)" in line for line in _markdown(tmp_path, results))


def test_a_peer_whose_in_memory_model_failed_is_judged_by_its_checkpoint(tmp_path: Path) -> None:
    """ModelOpt's MX fake quantization needs CUDA, its checkpoint does not: the verdict
    uses that checkpoint (read by our runtime), named as such; a peer with neither is not
    a peer of the verdict."""
    measured = {"ppl": 20.0, "agree": 0.9, "eval_s": 1.0}
    checkpoint = {**measured, "ppl": 19.0}
    results = {
        "meta": META,
        "rows": [
            _row("mxfp8", "exportlm", ckpt=measured, export_s=10.0, peak_rss=1e9),
            _row("mxfp8", "modelopt", mem_error="RuntimeError: CUDA", ckpt=checkpoint),
            _row("mxfp8", "llmcompressor", error="exit 1: ValueError: no scheme"),
        ],
    }
    lines = _markdown(tmp_path, results)
    verdict = [line for line in lines if line.startswith("- `mxfp8`")]
    assert verdict == [
        "- `mxfp8`: exportlm 20.000, better peer ModelOpt (its checkpoint) 19.000 (+5.3%): "
        "WORSE by more than 1%"
    ]


def test_the_verdict_adds_ours_against_modelopt_s_checkpoint_where_both_were_read(
    tmp_path: Path,
) -> None:
    """ModelOpt's AWQ model in memory holds per-linear scales its export averages: the
    verdict line also compares the two checkpoints read by the same runtime."""
    results = {
        "meta": META,
        "rows": [
            _row(
                "int4_awq",
                "exportlm",
                mem={"ppl": 29.4, "agree": 0.7},
                ckpt={"ppl": 29.3, "agree": 0.7},
            ),
            _row(
                "int4_awq",
                "modelopt",
                mem={"ppl": 28.8, "agree": 0.7},
                ckpt={"ppl": 29.5, "agree": 0.7},
            ),
        ],
    }
    lines = _markdown(tmp_path, results)
    verdict = [line for line in lines if line.startswith("- `int4_awq`")]
    assert verdict == [
        "- `int4_awq`: exportlm 29.400, better peer ModelOpt 28.800 (+2.1%): WORSE by more "
        "than 1%; checkpoints: ours 29.300, ModelOpt's 29.500 (-0.7%)"
    ]


def test_a_recipe_with_two_options_stays_one_recipe() -> None:
    """``--recipes int4_awq:group_size=64,clip=true`` is one recipe (it was split into
    ``int4_awq:group_size=64`` and ``clip=true``, and the peer ran the wrong config)."""
    split = _benchmark_module("quality").split_recipes
    assert split("int4_awq:group_size=64,clip=true") == ["int4_awq:group_size=64,clip=true"]
    assert split("fp8,int8_sq:alpha=0.5,none,w4a8_awq:group_size=64,clip=false") == [
        "fp8",
        "int8_sq:alpha=0.5",
        "w4a8_awq:group_size=64,clip=false",
    ]


def test_float32_matmuls_apply_to_every_evaluation_only_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--float32-matmuls``: a bf16 product inside ``measure`` is the float32 product
    rounded to bf16 (counted through exportlm's helper); without the flag, the model's own
    bf16 matmul runs."""
    import torch

    from exportlm.quant import _gemm

    metrics = _benchmark_module("_quality_metrics")
    calls: list[object] = []
    real = _gemm.float32_product
    monkeypatch.setattr(_gemm, "float32_product", lambda f, a: calls.append(f) or real(f, a))
    weight = torch.randn(32, 16, generator=torch.Generator().manual_seed(0)).bfloat16()
    data = {
        "eval_ids": torch.arange(9) % 32,
        "window": 8,
        "prompts": [torch.tensor([1, 2])],
        "answers": [[3, 4]],
    }

    def logits(ids: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.one_hot(ids, 16).bfloat16()
        return torch.nn.functional.linear(x, weight)

    monkeypatch.delenv(metrics.FLOAT32_MATMULS, raising=False)
    monkeypatch.setenv("EXPORTLM_FLOAT32_GEMM", "0")
    plain = metrics.measure(logits, data)
    assert calls == []
    monkeypatch.setenv(metrics.FLOAT32_MATMULS, "1")  # as quality.py sets both
    monkeypatch.setenv("EXPORTLM_FLOAT32_GEMM", "1")
    forced = metrics.measure(logits, data)
    assert calls, "the flag did not run the evaluation's bf16 matmuls in float32"
    assert forced["ppl"] == pytest.approx(plain["ppl"], rel=1e-2)  # one-hot rows: same bf16


def test_float32_matmuls_refuse_a_peer_without_exportlm() -> None:
    """llm-compressor's venv has no exportlm, so the flag cannot reach its calibration:
    refused with what to pass, before anything runs."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--float32-matmuls"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--peers exportlm,modelopt" in proc.stderr
