"""W8A8 (``w8a8``) against llm-compressor's own serialization (``-m interop``).

The seeded toy Llama is saved as a float checkpoint; llm-compressor (in its own
interpreter: its pins conflict with ours) runs ``SmoothQuantModifier(0.5)`` +
``QuantizationModifier(scheme="W8A8", ignore=["lm_head"])`` on it with
``oneshot(pipeline="basic")`` over the same calibration batch, and saves it
compressed; we run ``quantize(model, "w8a8")`` with that batch and export
``format="compressed-tensors"``. Compared:

* every tensor has the same name, dtype and shape; the int8 codes (``weight``) and
  everything not touched by smoothing are byte-equal; ``weight_scale`` (a row max
  over the smoothed weight) and the smoothed norms (a division by the smoothing
  scale, which comes from reductions over the calibration tokens) within
  :data:`SCALE_RTOL` (measured: scales byte-equal, norms within 1.2e-7);
* ``config.json``'s ``quantization_config``: every field we write has
  llm-compressor's value, but ``ignore`` (:data:`IGNORE_DIFFERENCE`); the fields it
  writes beyond ours are its defaults (:data:`LLMC_ONLY_FIELDS`).

The interpreter is ``EXPORTLM_LLMC_PYTHON`` (a venv with ``pip install llmcompressor``
and ``-c`` a constraints file pinning ``torch==2.13.0``, the CPU build; measured with
llmcompressor 0.14.0.1, compressed-tensors 0.19.0, transformers 5.17.0); without it
the test skips.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import exportlm
from exportlm.models import tiny_hf_model
from exportlm.quant import quantize

pytestmark = pytest.mark.interop

#: The environment variable naming llm-compressor's interpreter.
LLMC_ENV = "EXPORTLM_LLMC_PYTHON"
#: Relative bound on ``weight_scale`` and the smoothed norm weights (see the docstring).
SCALE_RTOL = 1e-6
#: ``ignore``: llm-compressor lists the linears it was told to skip (``lm_head``); we
#: also list the unquantized embedding. compressed-tensors' ``targets: ["Linear"]``
#: never matches an embedding, so both configs quantize the same modules.
IGNORE_DIFFERENCE = ({"lm_head"}, {"lm_head", "model.embed_tokens"})
#: Fields llm-compressor 0.14 writes that we do not, each with the value it writes.
LLMC_ONLY_FIELDS = {
    "global_compression_ratio": None,
    "sparsity_config": {},
    "transform_config": {},
}
#: Per quantization args, the extra keys it writes (None or its defaults; the weights'
#: observer is the one that computed their min/max, which the args do not change).
LLMC_ONLY_ARGS = {
    "actorder": None,
    "block_structure": None,
    "observer_kwargs": {},
    "scale_dtype": None,
    "zp_dtype": None,
}

_WORKER = """
import json, sys
import torch
from datasets import Dataset
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
import llmcompressor
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

source, batch, out = sys.argv[1:4]
rows = json.loads(open(batch).read())
model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
# The rows are token ids already: a one-word tokenizer only satisfies oneshot's rule
# that a dataset comes with a processor (nothing is tokenized).
processor = PreTrainedTokenizerFast(
    tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")), pad_token="<unk>"
)
oneshot(
    model=model,
    dataset=Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]}),
    processor=processor,
    recipe=[
        SmoothQuantModifier(smoothing_strength=0.5),
        QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"]),
    ],
    pipeline="basic",
    num_calibration_samples=len(rows),
    shuffle_calibration_samples=False,
    batch_size=len(rows),
)
model.save_pretrained(out, save_compressed=True)
print(json.dumps({"llmcompressor": llmcompressor.__version__}))
"""


def _llmc_python() -> str:
    path = os.environ.get(LLMC_ENV)
    if not path or not Path(path).is_file():
        pytest.skip(
            f"no llm-compressor interpreter: set {LLMC_ENV} to the python of a venv with "
            "llmcompressor installed (torch pinned to the CPU build)"
        )
    return path


def _export_both(family: str, tmp_path: Path, **overrides: Any) -> tuple[Path, Path]:
    python = _llmc_python()
    model = tiny_hf_model(family, seed=0, **overrides).eval()
    model.config.architectures = [type(model).__name__]  # llm-compressor picks mappings by it
    batch = torch.randint(
        0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    model.save_pretrained(tmp_path / "float")
    (tmp_path / "batch.json").write_text(json.dumps(batch.tolist()))
    (tmp_path / "worker.py").write_text(_WORKER)
    args = [str(tmp_path / p) for p in ("worker.py", "float", "batch.json", "llmc")]
    done = subprocess.run([python, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]

    def calibrate(m: Any) -> None:
        with torch.no_grad():
            m(batch)

    quantize(model, "w8a8", calibrate=calibrate)
    ours = exportlm.export_model(
        "hf_checkpoint", model, tmp_path / "ours", format="compressed-tensors"
    )
    return Path(ours), tmp_path / "llmc"


def _state(directory: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        state.update(load_file(shard))
    return state


def _config(directory: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((directory / "config.json").read_text())
    return dict(config["quantization_config"])


def _assert_tensor(name: str, ours: torch.Tensor, ref: torch.Tensor, smoothed: bool) -> None:
    assert (ours.dtype, ours.shape) == (ref.dtype, ref.shape), name
    if ref.dtype == torch.int8 or not (smoothed or name.endswith("weight_scale")):
        assert torch.equal(ours, ref), f"{name}: not byte-equal"
        return
    torch.testing.assert_close(ours, ref, rtol=SCALE_RTOL, atol=0, msg=name)


@pytest.mark.parametrize(
    ("family", "overrides"), [("llama", {}), ("llama", {"num_key_value_heads": 4})]
)
def test_w8a8_checkpoint_equals_llm_compressor(
    family: str, overrides: dict[str, Any], tmp_path: Path
) -> None:
    ours_dir, ref_dir = _export_both(family, tmp_path, **overrides)
    ours, ref = _state(ours_dir), _state(ref_dir)
    assert sorted(ours) == sorted(ref)
    model = tiny_hf_model(family, seed=0, **overrides)
    original = model.state_dict()
    smoothed = {n for n in ref if n.endswith("layernorm.weight")}
    for name in smoothed:  # smoothing happened in both, on the same norms
        assert not torch.equal(ref[name], original[name]), name
    for name, tensor in ref.items():
        _assert_tensor(name, ours[name], tensor, name in smoothed)

    mine, theirs = _config(ours_dir), _config(ref_dir)
    assert (set(theirs.pop("ignore")), set(mine.pop("ignore"))) == IGNORE_DIFFERENCE
    theirs.pop("version")  # compressed-tensors' version
    for key, value in LLMC_ONLY_FIELDS.items():
        assert theirs.pop(key) == value, key
    groups, their_groups = mine.pop("config_groups"), theirs.pop("config_groups")
    assert mine == theirs
    assert list(groups) == list(their_groups)
    for group, fields in groups.items():
        their = dict(their_groups[group])
        assert their.pop("output_activations") is None
        for role in ("weights", "input_activations"):
            args = dict(their[role])
            observer = args.pop("observer")
            assert observer == (None if role == "input_activations" else "memoryless_minmax")
            for key, value in LLMC_ONLY_ARGS.items():
                assert args.pop(key) == value, (role, key)
            their[role] = args
        assert fields == their
