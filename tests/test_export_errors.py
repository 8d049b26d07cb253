"""Bad input to the built-in targets: clear errors, and nothing on disk is lost.

Everything goes through ``exportlm.export_model`` / ``load_exported``, the way a
user calls it. The models here fail before (or early inside) the exporter, so the
file stays fast.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import exportlm
from exportlm.errors import (
    ExportFailedError,
    InvalidInputError,
    InvalidModelError,
    UnknownOptionError,
    UnsupportedDtypeError,
)
from exportlm.models import build_model

TARGETS = ("onnx", "torchscript", "torch_export")
SENTINEL = b"previous artifact: must survive a failed export\n"

pytestmark = pytest.mark.filterwarnings(
    "ignore::exportlm.export.torchscript.TorchScriptDeprecationWarning"
)


class _Boom(RuntimeError):
    pass


class _RaisesInForward(nn.Module):
    """Fails midway: the embedding runs, then the forward raises."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        raise _Boom(f"deliberate failure after embedding {tuple(hidden.shape)}")


class _NoLogits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids + 1  # an integer tensor, not logits


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("target", TARGETS)
def test_misspelled_kwarg_is_a_type_error_naming_target_and_options(
    tmp_path: Path, target: str
) -> None:
    with pytest.raises(
        TypeError, match=rf"'{target}'.*'example_input'.*accepted:.*example_inputs"
    ) as info:
        exportlm.export_model(target, build_model("decoder"), tmp_path / "x", example_input=None)
    assert isinstance(info.value, UnknownOptionError)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("target", TARGETS)
def test_forward_without_logits_is_an_invalid_model_error(tmp_path: Path, target: str) -> None:
    with pytest.raises(InvalidModelError, match="expected logits"):
        exportlm.export_model(target, _NoLogits(), tmp_path / "x")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("target", TARGETS)
def test_float_example_inputs_are_an_invalid_input_error(tmp_path: Path, target: str) -> None:
    with pytest.raises(InvalidInputError, match=r"integer tensor"):
        exportlm.export_model(
            target, build_model("decoder"), tmp_path / "x", example_inputs=torch.rand(2, 8)
        )
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("target", TARGETS)
def test_not_a_module_is_an_invalid_model_error(tmp_path: Path, target: str) -> None:
    with pytest.raises(InvalidModelError, match=r"torch\.nn\.Module"):
        exportlm.export_model(target, lambda ids: ids, tmp_path / "x")


@pytest.mark.parametrize("target", TARGETS)
def test_failure_midway_leaves_no_file_and_keeps_the_previous_artifact(
    tmp_path: Path, target: str
) -> None:
    out = tmp_path / "model.bin"
    out.write_bytes(SENTINEL)
    with pytest.raises(
        ExportFailedError, match=rf"{target} export of _RaisesInForward failed"
    ) as info:
        exportlm.export_model(target, _RaisesInForward(), out)
    chain: list[BaseException] = []
    err: BaseException | None = info.value
    while err is not None:
        chain.append(err)
        err = err.__cause__ or err.__context__
    assert any(isinstance(e, _Boom) for e in chain), [type(e).__name__ for e in chain]
    assert out.read_bytes() == SENTINEL
    assert _listing(tmp_path) == ["model.bin"]  # no temporaries left behind


@pytest.mark.parametrize("target", TARGETS)
def test_failed_export_restores_experts_and_train_mode(tmp_path: Path, target: str) -> None:
    model = build_model("qwen3_moe")
    model.train()

    def fail(module: nn.Module, args: object) -> None:
        raise _Boom("lm_head refuses to run")

    model.lm_head.register_forward_pre_hook(fail)
    assert model.get_experts_implementation() == {"": "grouped_mm"}
    with pytest.raises(ExportFailedError):
        exportlm.export_model(target, model, tmp_path / "m")
    assert model.get_experts_implementation() == {"": "grouped_mm"}
    assert all(m.training for m in model.modules())
    assert not any(tmp_path.iterdir())


def test_unknown_target_lists_the_available_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"onnx.*torch_export.*torchscript"):
        exportlm.export_model("onnxx", build_model("decoder"), tmp_path / "x")


def test_bad_option_values_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="method must be"):
        exportlm.export_model("torchscript", build_model("decoder"), tmp_path / "x", method="jit")
    with pytest.raises(InvalidInputError, match="opset"):
        exportlm.export_model("onnx", build_model("decoder"), tmp_path / "x", opset="20")


@pytest.mark.parametrize(
    ("opset", "says"),
    [
        (17, "torch's dynamo exporter writes opset 18 or newer"),
        (99, "opset 99 is newer than any the installed onnx knows"),
    ],
)
def test_an_opset_the_exporter_would_not_write_is_refused(
    tmp_path: Path, opset: int, says: str
) -> None:
    """torch 2.13's dynamo exporter wrote opset 18 for both, without a word."""
    out = tmp_path / "x.onnx"
    with pytest.raises(InvalidInputError, match=says):
        exportlm.export_model("onnx", build_model("decoder"), out, opset=opset)
    assert not out.exists()


def test_an_opset_below_18_is_written_by_the_torchscript_exporter(tmp_path: Path) -> None:
    import onnx

    out = exportlm.export_model(  # llama: transformers' RMSNorm is plain ops (no aten::rms_norm)
        "onnx", build_model("llama"), tmp_path / "x.onnx", opset=17, dynamo=False
    )
    written = onnx.load(str(out), load_external_data=False).opset_import
    assert [o.version for o in written if o.domain in ("", "ai.onnx")] == [17]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return exportlm.export_model(
        "torchscript", build_model("decoder"), tmp_path_factory.mktemp("ts") / "d.pt"
    )


def test_runtime_refuses_float_input_ids(traced: Path) -> None:
    runtime = exportlm.load_exported("torchscript", traced)
    with pytest.raises(InvalidInputError, match=r"torchscript runtime: .*integer"):
        runtime(torch.rand(1, 4))


def test_runtime_unknown_kwarg_and_missing_file(traced: Path, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="runtime of target 'torchscript'"):
        exportlm.load_exported("torchscript", traced, devcie="cpu")
    with pytest.raises(FileNotFoundError, match="no TorchScript file"):
        exportlm.load_exported("torchscript", tmp_path / "missing.pt")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("target", ["torchscript", "torch_export"])
def test_cuda_runtime_without_cuda_says_so(traced: Path, target: str, tmp_path: Path) -> None:
    # each runtime gets its own target's artifact: a manifest vouches for one target only
    artifact = (
        traced
        if target == "torchscript"
        else exportlm.export_model(target, build_model("decoder"), tmp_path / "d.pt2")
    )
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        exportlm.load_exported(target, artifact, device="cuda")


def test_export_prints_nothing_and_logs_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="exportlm")
    exportlm.export_model("onnx", build_model("decoder"), tmp_path / "d.onnx", optimize=False)
    captured = capsys.readouterr()
    assert "[torch.onnx]" not in captured.out + captured.err
    assert "torchvision" not in captured.out + captured.err
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("exportlm")]
    assert len(ours) == 1, ours  # exactly one: the summary of what the export hid
    assert ours[0].startswith("onnx export: "), ours


def test_torchscript_folds_deprecations_into_one_warning(tmp_path: Path) -> None:
    from exportlm.export.torchscript import TorchScriptDeprecationWarning

    with pytest.warns(TorchScriptDeprecationWarning) as record:
        exportlm.export_model("torchscript", build_model("decoder"), tmp_path / "d.pt")
    ours = [w for w in record if issubclass(w.category, TorchScriptDeprecationWarning)]
    assert len(ours) == 1
    assert ours[0].filename == __file__  # attributed to the caller, not to exportlm
    assert not [w for w in record if issubclass(w.category, DeprecationWarning)]


class _ColouredFailure(nn.Module):
    """Raises the way torch.onnx does: its message carries terminal colour codes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.embed(input_ids)
        raise _Boom("Failed to export. \x1b[96mThis is step 1/3\x1b[0m of exporting.")


def test_exporter_failure_message_has_no_terminal_colour_codes(tmp_path: Path) -> None:
    with pytest.raises(ExportFailedError) as info:
        exportlm.export_model("torch_export", _ColouredFailure(), tmp_path / "x.pt2")
    message = str(info.value)
    assert "\x1b" not in message
    assert "Failed to export. This is step 1/3 of exporting." in message
    assert isinstance(info.value.__cause__, _Boom)  # the original, colours and all, is chained


def test_onnx_refuses_a_bfloat16_model_naming_the_supported_dtypes(tmp_path: Path) -> None:
    out = tmp_path / "m.onnx"
    out.write_bytes(SENTINEL)
    model = build_model("decoder").to(torch.bfloat16)
    with pytest.raises(UnsupportedDtypeError) as info:
        exportlm.export_model("onnx", model, out)
    message = str(info.value)
    assert "torch.bfloat16 tensors" in message  # the problem
    assert "Supported dtypes: float32, float16" in message  # what is expected
    assert "model.float()" in message  # the fix
    assert out.read_bytes() == SENTINEL  # refused before anything was written
    assert _listing(tmp_path) == ["m.onnx"]


def test_onnx_float16_model_roundtrips_in_onnxruntime(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    model = build_model("decoder").eval()
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    with torch.no_grad():
        expected = model(ids).float()
    half = exportlm.export_model("onnx", copy.deepcopy(model).half(), tmp_path / "h.onnx")
    logits = exportlm.load_exported("onnx", half)(ids)
    assert logits.dtype == torch.float16
    # float16 weights and activations: measured max |diff| 7.6e-4 on this model's logits
    # (magnitude ~1); 1e-2 leaves a >10x margin and still fails a wrong graph.
    torch.testing.assert_close(logits.float(), expected, atol=1e-2, rtol=1e-2)
