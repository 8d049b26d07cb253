"""Tied weights in a quantized export: written once, under the source name, recorded as tied."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from exportlm.errors import TiedWeightsError
from exportlm.models import DecoderModel, tiny_hf_model
from exportlm.module_exporters import DictSink, QuantExportSummary, export_quantized_state
from exportlm.quant import QuantEmbedding, QuantLinear, quantize

#: Both tied modules quantized alike: one FP8 tensor can stand for both.
BOTH_FP8 = {"*": "fp8", "*lm_head*": "fp8", "*embed_tokens": "fp8"}


def _export(model: nn.Module) -> tuple[dict[str, torch.Tensor], QuantExportSummary]:
    sink = DictSink()
    summary = export_quantized_state(model, sink)
    assert list(sink.tensors) == list(summary.tensor_names)  # the summary names what was written
    return sink.tensors, summary


def _tied_decoder() -> DecoderModel:
    return DecoderModel(num_layers=1, tie_embeddings=True)


def test_two_quantized_modules_sharing_one_parameter_write_it_once_under_the_source() -> None:
    model = quantize(_tied_decoder(), BOTH_FP8)
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert isinstance(model.lm_head, QuantLinear)
    assert model.lm_head.weight is model.embed_tokens.weight
    tensors, summary = _export(model)
    assert tensors["embed_tokens.weight"].dtype == torch.float8_e4m3fn
    assert "embed_tokens.weight_scale" in tensors
    assert "lm_head.weight" not in tensors
    assert "lm_head.weight_scale" not in tensors
    assert "lm_head.input_scale" in tensors  # lm_head's own activation scale stays
    assert summary.tied_weights == {
        "lm_head.weight": "embed_tokens.weight",
        "lm_head.weight_scale": "embed_tokens.weight_scale",
    }
    assert {"embed_tokens", "lm_head"} <= set(summary.quantized_layers)


def test_tied_quantized_hf_model_keeps_the_embedding_side() -> None:
    model = quantize(tiny_hf_model("llama_tied", num_hidden_layers=1), BOTH_FP8)
    tensors, summary = _export(model)
    assert tensors["model.embed_tokens.weight"].dtype == torch.float8_e4m3fn
    assert "lm_head.weight" not in tensors
    assert summary.tied_weights["lm_head.weight"] == "model.embed_tokens.weight"


def test_unquantized_ties_are_recorded_too() -> None:
    tensors, summary = _export(quantize(_tied_decoder(), "fp8"))  # lm_head stays unquantized
    assert "lm_head.weight" not in tensors
    assert summary.tied_weights == {"lm_head.weight": "embed_tokens.weight"}


def test_tied_modules_quantized_differently_raise_naming_both() -> None:
    model = quantize(_tied_decoder(), {"*": "fp8", "*lm_head*": "fp8", "*embed_tokens": "int8_wo"})
    with pytest.raises(TiedWeightsError, match=r"'lm_head\.weight' and 'embed_tokens\.weight'"):
        _export(model)


def test_only_one_quantized_side_of_a_tie_raises() -> None:
    model = quantize(_tied_decoder(), {"*": "fp8", "*lm_head*": "fp8"})
    with pytest.raises(TiedWeightsError, match=r"only 'lm_head' is quantized"):
        _export(model)
