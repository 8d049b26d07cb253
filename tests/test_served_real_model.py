"""A real trained model served in real engines, with chat prompts (issues 41 and 45).

SmolLM2-135M-Instruct (``tests/_real_model.py``: bf16, hidden 576, a chat template) is
exported from its directory with the CLI, as users export it, once per module, and
served out of process by :func:`exportlm.engines.serve_and_compare` (the ``served``
check's comparison): questions put through the model's chat template, their greedy
answers, teacher-forced logprobs and decode steps against the eager reference, within
the engine's stated tolerance for the dtype and scheme.

The eager reference is computed in float32, as every engine tolerance is stated: the
bf16 directory's weights for the plain checkpoint and the ONNX graph (exported with
``-o dtype=fp32``), and for a quantized checkpoint the checkpoint as exportlm's loader
reads it (``load_exported("hf_checkpoint", ckpt, dtype="float32")``: the fake-quantized
model with its stored scales). Chat answers have near-ties of their own (the first
token of "What is the capital of France?" wins by a logit margin of 0.1 in float32),
so a comparison in a reduced dtype passes under the served check's near-tie rule:
greedy tokens may part only where the eager top-2 margin is within twice the
tolerance, and every logprob compared stays within it.

Calibration is small (8 lines of prose x 32 tokens), INT4 AWQ's search included.
Each engine's interpreter comes from ``EXPORTLM_ENGINE_<NAME>`` (``make test-engines``
sets it to the venvs ``make engines`` builds); without one the test skips naming
``make engines``, so ``make test`` exports nothing here.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import exportlm
from exportlm.cli import main
from exportlm.engines import (
    Outcome,
    Served,
    Verdict,
    find_interpreter,
    get_engine,
    serve_and_compare,
)

pytestmark = [pytest.mark.engines, pytest.mark.real_model]

#: Asked as one left-padded batch, each through the chat template (with its default
#: system turn), 8 new tokens: "The capital of France is Paris.<|im_end|>" in float32.
QUESTIONS = (
    "What is the capital of France?",
    "How many days are in a week?",
    "Who wrote Romeo and Juliet?",
)
CALIBRATION = (
    "The river runs past the old mill and on towards the sea, where the boats wait for the tide.",
    "Every morning the baker opens the shop before the town is awake.",
    "She wrote a long letter to her brother about the mountains, the lakes and the people.",
    "The committee met on Tuesday to discuss the budget for the new library.",
    "Water boils at one hundred degrees Celsius at sea level, and freezes at zero degrees.",
    "The train was late again, so he read his book on the platform and watched the pigeons.",
    "In the autumn the leaves turn red and gold, and the farmers bring in the harvest.",
    "A good soup begins with onions, carrots and celery, cooked slowly in butter.",
)
_CT = ["-o", "format=compressed-tensors"]
_CALIB = ["--calib-samples", "8", "--calib-seq-len", "32"]
#: The CLI arguments of each export (``--calib-data`` added where ``_CALIB`` is).
EXPORTS: dict[str, list[str]] = {
    "bf16": ["--target", "hf_checkpoint"],
    "w8a8": ["--target", "hf_checkpoint", "--quantize", "w8a8", *_CT, *_CALIB],
    "fp8": ["--target", "hf_checkpoint", "--quantize", "fp8", *_CT, *_CALIB],
    # group 64 divides 576. Every linear quantized, as users ask for it: down_proj's AWQ
    # scale folds into up_proj, o_proj (9 heads / 3 KV heads: v_proj's outputs are not
    # o_proj's inputs) is round-to-nearest, q/k/v and gate/up fold into the norms.
    "w4a16": ["--target", "hf_checkpoint", "--quantize", "int4_awq:group_size=64", *_CT, *_CALIB],
    "onnx": [
        "--target",
        "onnx",
        "-o",
        "kv_cache=true",
        "-o",
        "layout=optimum",
        "-o",
        "genai_config=true",
        "-o",
        "dtype=fp32",
    ],
}


def _python(name: str) -> Path:
    """The engine's venv, given by ``EXPORTLM_ENGINE_<NAME>``: never this interpreter (where
    transformers imports, ``make test`` would export the real model for it)."""
    found = find_interpreter(name)
    if found.path is None:
        pytest.skip(f"{found.reason}. Run `make engines` (or `make test-engines`)")
    if found.source == "current":
        pytest.skip(
            f"{name}: give its venv with EXPORTLM_ENGINE_* (`make engines`, then "
            "`make test-engines`); the real model is not served from this interpreter"
        )
    probe = subprocess.run([str(found.path), "-E", "-s", "-c", "import sys"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"{found.path} ({found.source}) does not run: `make engines`")
    return found.path


def export_argv(kind: str, model_dir: Path, data: Path) -> list[str]:
    """The CLI arguments of :data:`EXPORTS`' ``kind`` (``--calib-data data`` where it
    calibrates), without ``--out``: the benchmarks export the same way."""
    argv = ["export", "--model", str(model_dir), *EXPORTS[kind], "-q"]
    return [*argv, "--calib-data", str(data)] if "--calib-samples" in argv else argv


@pytest.fixture(scope="module")
def exported(
    real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """``make(kind)``: the CLI's export of the real model (:data:`EXPORTS`), once per module."""
    root = tmp_path_factory.mktemp("served_real")
    data = root / "calib.txt"
    data.write_text("\n".join(CALIBRATION) + "\n")
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            out = root / kind / ("model.onnx" if kind == "onnx" else "ckpt")
            assert main([*export_argv(kind, real_model_dir, data), "--out", str(out)]) == 0, kind
            made[kind] = out
        return made[kind]

    return make


@pytest.fixture(scope="module")
def tokenizer(real_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


@pytest.fixture(scope="module")
def float_model(real_model_dir: Path) -> Any:
    """The bf16 directory's weights, computed in float32 (eager attention, as the runtimes)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        real_model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def chat_ids(tokenizer: Any, question: str) -> list[int]:
    """``question`` as one user turn through the model's chat template, as token ids."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(i) for i in ids]


def _serve(
    engine: str,
    artifact: Path,
    reference: Any,
    tokenizer: Any,
    *,
    dtype: str | None = None,
) -> Served:
    """``artifact`` served by ``engine`` on the chat questions, against ``reference``."""
    python = _python(engine)
    prompts = [chat_ids(tokenizer, question) for question in QUESTIONS]
    got = serve_and_compare(
        engine, artifact, reference, prompts=prompts, dtype=dtype, python=python
    )
    print(f"{engine} {got.kind}: {got.outcome.value}: {got.message}")
    return got


def _passed(got: Served) -> None:
    """The eager answers, under the near-tie rule: tokens equal, or parting only where the
    eager top-2 margin is within twice the tolerance (a near-tie, named, never a pass);
    teacher-forced and decode-step logprobs within the tolerance either way."""
    if got.off_table:
        pytest.skip(f"{got.engine}'s table is {got.table_version}, found {got.engine_version}")
    assert got.outcome in (Outcome.PASSED, Outcome.NEAR_TIE), got.message
    assert got.max_gap is not None
    assert got.atol is not None
    assert got.max_gap <= got.atol, got.message
    assert got.decode_gap is None or got.decode_gap <= got.atol, got.message


def _stored(path: Path) -> Any:
    """A quantized checkpoint as exportlm's loader reads it, computed in float32."""
    return exportlm.load_exported("hf_checkpoint", path, dtype="float32")


def test_vllm_serves_the_bf16_checkpoint(
    exported: Callable[[str], Path], float_model: Any, tokenizer: Any
) -> None:
    got = _serve("vllm", exported("bf16"), float_model, tokenizer, dtype="bfloat16")
    _passed(got)


def test_vllm_serves_the_compressed_tensors_w4a16_checkpoint(
    exported: Callable[[str], Path], tokenizer: Any
) -> None:
    """INT4, group 64 (576 = 9 x 64), pack-quantized; vLLM CPU computes it in float16."""
    _python("vllm")
    path = exported("w4a16")
    match = get_engine("vllm").support(
        "hf_checkpoint",
        "compressed-tensors",
        "W4A16",
        dtype="float16",
        device="cpu",
        model_type="llama",
    )
    got = _serve("vllm", path, _stored(path), tokenizer, dtype="float16")
    if match.verdict is Verdict.ENGINE_LIMIT:  # an AVX2 CPU: no cpu_gemm_wna16
        assert got.outcome is Outcome.ENGINE_LIMIT, got.message
        return
    _passed(got)


def test_vllm_serves_the_compressed_tensors_w8a8_checkpoint(
    exported: Callable[[str], Path], tokenizer: Any
) -> None:
    """int8 weights, dynamic per-token int8 inputs, computed in bfloat16. Without AMX tiles
    the table declares that vLLM CPU misreads it (its oneDNN int8 GEMM): confirmed here,
    or a near-tie, which neither confirms nor refutes the row. On this model the gap of a
    right computation comes close to the misread's (torch's own bf16 forward 1.53 off,
    vLLM with AMX 1.49, vLLM without AMX 1.99: its tolerance, 2.0, is this model's)."""
    _python("vllm")
    path = exported("w8a8")
    match = get_engine("vllm").support(
        "hf_checkpoint",
        "compressed-tensors",
        "W8A8",
        dtype="bfloat16",
        device="cpu",
        model_type="llama",
    )
    got = _serve("vllm", path, _stored(path), tokenizer, dtype="bfloat16")
    if match.verdict is Verdict.MISREADS:
        assert got.outcome in (Outcome.MISREADS, Outcome.NEAR_TIE), got.message
        return
    _passed(got)


def test_optimum_serves_the_kv_cache_graph(
    exported: Callable[[str], Path], float_model: Any, tokenizer: Any
) -> None:
    """The bf16 directory exported as a float32 kv_cache graph in Optimum's folder."""
    _python("optimum-onnxruntime")
    _passed(_serve("optimum-onnxruntime", exported("onnx"), float_model, tokenizer))


def test_onnxruntime_genai_serves_the_graph_on_chat_prompts(
    exported: Callable[[str], Path], float_model: Any, tokenizer: Any
) -> None:
    """SmolLM2's pad_token_id is 2, ``<|im_end|>``, which every chat turn ends with;
    onnxruntime-genai masks every position holding genai_config.json's pad id. The export
    carried the directory's tokenizer and named a special token that no chat prompt holds
    as that id (``<|endoftext|>``, 0), so the chat prompts are served as they are, and the
    served check's own prompts too."""
    python = _python("onnxruntime-genai")
    genai = json.loads((exported("onnx").parent / "genai_config.json").read_text())
    assert tokenizer.pad_token_id == 2 == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert genai["model"]["pad_token_id"] == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    chat = _serve("onnxruntime-genai", exported("onnx"), float_model, tokenizer)
    print(f"onnxruntime-genai, chat prompts: {chat.message}")
    _passed(chat)
    got = serve_and_compare("onnxruntime-genai", exported("onnx"), float_model, python=python)
    print(f"onnxruntime-genai, token prompts: {got.message}")
    _passed(got)


@pytest.mark.xfail(
    strict=False,
    reason="measured 2026-12-05 on an AMD EPYC (no AMX): with the reference in the checkpoint's "
    "own dtype (bf16, eager attention) the max logprob gap is 0.737 (tolerance 0.75), but "
    "transformers' default attention (sdpa) in bf16 picks a token outside eager's top-2 at a "
    "0.688 margin on row 0, step 3; with eager attention on both sides transformers computes "
    "this checkpoint exactly (benchmarks/ct_scales_real.py: 0.0), so the gap is attention-kernel "
    "noise in bf16, not the scales. On an Intel Xeon with AMX (2026-12-06) further: 1.7 off "
    "at row 2, position 1, and a token eager does not rank within twice the tolerance",
)
def test_verify_takes_our_ct_fp8_checkpoint_as_its_own_reference(
    exported: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """``exportlm verify CKPT --engine transformers`` with no --model: the reference is the
    checkpoint as exportlm's loader reads it, so nothing calibrates again (issue 45)."""
    import json

    python = _python("transformers")
    path = exported("fp8")
    capsys.readouterr()
    argv = ["verify", str(path), "--engine", "transformers", "--python", str(python), "--json"]
    code = main(argv)
    row = json.loads(capsys.readouterr().out)
    print(f"verify {path}: exit {code}: {row['message']}")
    assert (row["layout"], row["scheme"], row["dtype"]) == ("compressed-tensors", "FP8", "bfloat16")
    assert code == 0, row["message"]
    assert row["outcome"] == "passed"
