"""A model directory whose config or weights are not a float model's is refused, naming why.

``exportlm export --model DIR`` and ``export_model("hf_checkpoint", DIR, ...)``, in memory
and streamed. Each case is a copy of a toy model directory with one thing edited, the way a
hand-edited config, a partial download or the wrong directory reaches users. Before, the
in-memory export took most of them: a checkpoint with no decoder layer (``num_hidden_layers:
-1``), a missing weight initialised at random by transformers, integer codes cast to float
weights, and an FP8 checkpoint re-exported as if its codes were weights all exported without
an error; the rest surfaced transformers' or huggingface_hub's own exceptions
(``StrictDataclassFieldValidationError``, ``RuntimeError``, ``AttributeError``, and a
``generation_config.json`` transformers refuses: ``ValueError``, ``TypeError``).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import exportlm
from exportlm.cli import main
from exportlm.errors import ExportLMError, InvalidConfigError
from tests._malformed import edit_json, edit_tensors
from tests._model_dirs import toy_model_dir

SHARD = "model.safetensors"
DOWN = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return toy_model_dir(tmp_path_factory.mktemp("source") / "llama")


@pytest.fixture(scope="module")
def quantized(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The toy exported as FP8 in each layout: a quantized checkpoint passed as a source."""
    root = tmp_path_factory.mktemp("quantized")
    return {
        layout: exportlm.export_model(
            "hf_checkpoint", base, root / layout, recipe="fp8", format=layout
        )
        for layout in ("modelopt", "compressed-tensors")
    }


def _config(field: str, value: Any) -> Callable[[Path], None]:
    def edit(directory: Path) -> None:
        edit_json(directory / "config.json", lambda c: {**c, field: value})

    return edit


def _generation(value: Any) -> Callable[[Path], None]:
    def edit(directory: Path) -> None:
        edit_json(directory / "generation_config.json", lambda _: value)

    return edit


def _tensors(change: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    return lambda directory: edit_tensors(directory / SHARD, change)


def _index_with_a_missing_shard(directory: Path) -> None:
    """A sharded checkpoint missing its second shard (a partial download)."""
    from safetensors.torch import save_file

    tensors = load_file(directory / SHARD)
    (directory / SHARD).unlink()
    first = {k: v for k, v in tensors.items() if ".layers.1." not in k}
    save_file(first, directory / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    weight_map = {k: f"model-0000{1 if k in first else 2}-of-00002.safetensors" for k in tensors}
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def _as_int32(t: dict[str, torch.Tensor]) -> None:
    t[DOWN] = (t[DOWN] * 100).to(torch.int32)


#: case -> (edit, what the refusal says)
CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "no decoder layer": (
        _config("num_hidden_layers", -1),
        "num_hidden_layers is -1, expected a positive int",
    ),
    "a size field of the wrong type": (
        _config("hidden_size", "abc"),
        "hidden_size is 'abc', expected a positive int",
    ),
    "a dtype torch has no name for": (
        _config("dtype", "float99"),
        "dtype is 'float99', expected the name of a torch floating-point dtype",
    ),
    "a config transformers' own validators refuse": (
        _config("num_attention_heads", 7),
        "",  # transformers' words (its version's); the directory is named
    ),
    "a vocabulary the weights do not have": (
        _config("vocab_size", 10),
        "the config expects [10, ",
    ),
    "a generation config transformers refuses": (
        _generation({"max_new_tokens": -5}),
        "max_new_tokens",
    ),
    "a generation config that is no object": (_generation([1, 2]), "holds a JSON list"),
    # transformers copies these unchecked: the checkpoint's generate() raised "new():
    # invalid data type 'str'" / never stopped
    "an end-of-sequence id that is a string": (
        _generation({"eos_token_id": "x"}),
        "eos_token_id is 'x'; expected a token id (an int) or a non-empty list of them",
    ),
    "an end-of-sequence id outside the vocabulary": (
        _generation({"eos_token_id": [2, 10**6]}),
        "1000000 is not an id of the vocabulary [0, ",
    ),
    # transformers ignores a file it cannot parse: the checkpoint's generation config
    # would have been made from config.json, with no word
    "a generation config that is not JSON": (
        lambda d: (d / "generation_config.json").write_bytes(b'{"eos_token_id": [2, \x00'),
        "generation_config.json is not valid JSON",
    ),
    # built layer by layer by transformers: 10**9 of them took hours (the CLI's recipe
    # check built them from config.json before anything was read)
    "layers the shards do not store": (
        _config("num_hidden_layers", 10**9),
        "layer(s) 2..999999999 are missing",
    ),
    "a size no tensor shape can hold": (  # torch's raw TypeError before
        _config("hidden_size", 10**30),
        "expected a positive int (at most 2**40)",
    ),
    "an index naming a shard that is not there": (
        _index_with_a_missing_shard,
        "names shard 'model-00002-of-00002.safetensors', which is not in the directory",
    ),
    "a missing weight": (_tensors(lambda t: t.pop(DOWN)), DOWN),
    # transformers builds from model_type, vLLM from architectures: exported as llama
    # while the engines would have read the source as qwen2
    "architectures of another model type": (
        _config("architectures", ["Qwen2ForCausalLM"]),
        "architectures names Qwen2ForCausalLM, a 'qwen2' model, but its model_type is 'llama'",
    ),
    "integer codes where a float weight is": (_tensors(_as_int32), "stored as I32"),
}


def _edited(base: Path, root: Path, edit: Callable[[Path], None]) -> Path:
    directory = root / "edited"
    shutil.copytree(base, directory)
    edit(directory)
    return directory


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_source_that_is_not_its_configs_float_model_is_refused(
    base: Path, tmp_path: Path, case: str, stream: bool
) -> None:
    edit, says = CASES[case]
    directory = _edited(base, tmp_path, edit)
    out = tmp_path / "out"
    with pytest.raises(ExportLMError) as raised:
        exportlm.export_model("hf_checkpoint", directory, out, recipe="fp8", stream=stream)
    message = str(raised.value)
    assert says in message
    assert str(directory) in message or "config.json" in message
    assert not out.exists()


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_cli_refuses_it_as_bad_input_not_a_crash(
    base: Path, tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    edit, says = CASES[case]
    directory = _edited(base, tmp_path, edit)
    args = ["export", "--target", "hf_checkpoint", "--model", str(directory), "--quantize", "fp8"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert says in err
    assert "(run with -v for the traceback)" not in err  # a dependency's exception, raw
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_a_quantized_checkpoint_is_no_source(
    quantized: dict[str, Path], tmp_path: Path, layout: str, stream: bool
) -> None:
    """Re-quantizing our own FP8 export exported, in memory (ModelOpt layout: transformers
    read the codes as weights) and streamed (both layouts), without an error."""
    with pytest.raises(InvalidConfigError, match="holds a quantized checkpoint") as raised:
        exportlm.export_model(
            "hf_checkpoint", quantized[layout], tmp_path / "out", recipe="fp8", stream=stream
        )
    assert f"exportlm inspect {quantized[layout]}" in str(raised.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
def test_a_stored_tensor_the_model_has_no_place_for_is_named_and_left_out(
    base: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    """Checkpoints carry weights transformers does not load (DeepSeek-V3's multi-token
    prediction layers): not refused, said, by both paths alike."""
    directory = _edited(
        base, tmp_path, _tensors(lambda t: t.update({"extra.weight": torch.ones(4)}))
    )
    with caplog.at_level(logging.WARNING, logger="exportlm"):
        result = exportlm.export_model(
            "hf_checkpoint", directory, tmp_path / "out", recipe="fp8", stream=stream
        )
    assert (result / SHARD).is_file()
    assert "extra.weight" not in load_file(result / SHARD)
    (said,) = [r.getMessage() for r in caplog.records if "no weight of" in r.getMessage()]
    assert said.endswith(
        "1 stored tensor(s) are no weight of LlamaForCausalLM and are left out (extra.weight)"
    )


def _what_transformers_ignores(t: dict[str, torch.Tensor]) -> None:
    """What older checkpoints store and transformers drops on purpose, without a word."""
    t["model.rotary_emb.inv_freq"] = torch.ones(4)  # a non-persistent buffer now
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # moved to the model


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
def test_what_transformers_ignores_is_left_out_without_a_warning(
    base: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    directory = _edited(base, tmp_path, _tensors(_what_transformers_ignores))
    with caplog.at_level(logging.WARNING, logger="exportlm"):
        exportlm.export_model(
            "hf_checkpoint", directory, tmp_path / "out", recipe="fp8", stream=stream
        )
    assert "no weight of" not in caplog.text


def _lm_head_stored_apart(t: dict[str, torch.Tensor]) -> None:
    t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
def test_a_tie_the_config_declares_over_two_different_stored_tensors_is_refused(
    base: Path, tmp_path: Path, stream: bool
) -> None:
    """Two models in one directory: transformers loads both tensors, an engine that ties
    them one. The streamed export read the embedding for both and wrote one, silently."""
    from exportlm.errors import TiedWeightsError

    def edit(directory: Path) -> None:
        _config("tie_word_embeddings", True)(directory)
        _tensors(_lm_head_stored_apart)(directory)

    directory = _edited(base, tmp_path, edit)
    out = tmp_path / "out"
    with pytest.raises(TiedWeightsError, match=r"'lm_head\.weight' is declared tied to"):
        exportlm.export_model("hf_checkpoint", directory, out, recipe="fp8", stream=stream)
    assert not out.exists()


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
def test_a_tied_copy_stored_equal_exports(base: Path, tmp_path: Path, stream: bool) -> None:
    def edit(directory: Path) -> None:
        _config("tie_word_embeddings", True)(directory)
        _tensors(lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))(
            directory
        )

    directory = _edited(base, tmp_path, edit)
    out = exportlm.export_model("hf_checkpoint", directory, tmp_path / "out", stream=stream)
    assert "lm_head.weight" not in load_file(out / SHARD)  # one copy, as save_pretrained writes


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
def test_a_safetensors_file_transformers_does_not_read_is_not_held_against_it(
    base: Path, tmp_path: Path, stream: bool
) -> None:
    """Only ``model.safetensors`` (else the index's shards) is the model: a stray file beside
    it (an old run's, a ``consolidated.safetensors``) with a model tensor's name in another
    shape was refused in memory ("has shape [3, 3] in old-run.safetensors")."""

    def edit(directory: Path) -> None:
        stray = {"model.embed_tokens.weight": torch.zeros(3, 3)}
        save_file(stray, str(directory / "old-run.safetensors"))

    directory = _edited(base, tmp_path, edit)
    out = exportlm.export_model("hf_checkpoint", directory, tmp_path / "out", stream=stream)
    original = load_file(base / SHARD)["model.embed_tokens.weight"]
    assert torch.equal(load_file(out / SHARD)["model.embed_tokens.weight"], original)


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
@pytest.mark.parametrize(
    ("architecture", "says"),
    [
        ("LlamaForSequenceClassification", "architectures names LlamaForSequenceClassification; "),
        (
            "NoSuchModelForCausalLM",
            "architectures names NoSuchModelForCausalLM, which transformers",
        ),
    ],
)
def test_an_architecture_of_the_same_model_type_exports_as_the_causal_lm_said_once(
    base: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    stream: bool,
    architecture: str,
    says: str,
) -> None:
    directory = _edited(base, tmp_path, _config("architectures", [architecture]))
    with caplog.at_level(logging.WARNING, logger="exportlm"):
        out = exportlm.export_model(
            "hf_checkpoint", directory, tmp_path / "out", recipe="fp8", stream=stream
        )
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    said = [r.getMessage() for r in caplog.records if says in r.getMessage()]
    assert len(said) == 1, caplog.text  # the export checks the config three times
    assert "exporting the causal LM" in said[0]
    assert "LlamaForCausalLM" in said[0]
