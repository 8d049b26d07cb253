"""The stable ONNX API: ``export_to_onnx``, ``verify_onnx``, ``get_onnx_info``.

One dynamo export of the plain decoder and one legacy export of tiny Llama are
shared by the module (``artifacts`` fixture); the remaining exports use the fast
legacy exporter.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import exportlm
from exportlm.export import infer_vocab_size, make_input_ids
from exportlm.export.onnx import (
    DEFAULT_OPSET,
    ONNX_ATOL,
    LegacyTraceWarning,
    OnnxInfo,
    OnnxVerification,
    export_to_onnx,
    get_onnx_info,
    load_onnx,
    verify_onnx,
)
from exportlm.models import build_model
from tests._exports import shared_export

# Legacy exports of transformers models emit our LegacyTraceWarning (transformers' masking
# converts tensors to Python values); it is asserted where it is the subject.
# torch's legacy exporter also warns about aten::index with negative indices (it has none here).
pytestmark = [
    pytest.mark.filterwarnings("ignore::exportlm.export.onnx.LegacyTraceWarning"),
    pytest.mark.filterwarnings("ignore:Exporting aten.{2}index operator:UserWarning"),
]


@dataclasses.dataclass
class Artifacts:
    decoder: nn.Module
    decoder_onnx: Path
    llama: nn.Module
    llama_legacy: Path


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Artifacts:
    root = tmp_path_factory.mktemp("onnx_api")
    decoder = shared_export(tmp_path_factory, "onnx", "decoder")  # read only here
    llama = build_model("llama")
    return Artifacts(
        decoder=decoder.model,
        decoder_onnx=decoder.path,
        llama=llama,
        llama_legacy=export_to_onnx(llama, root / "llama_legacy.onnx", dynamo=False),
    )


def _ids(model: nn.Module, batch: int, seq: int) -> torch.Tensor:
    return make_input_ids(infer_vocab_size(model), batch, seq, seed=3)


def test_info_of_a_dynamo_export(artifacts: Artifacts) -> None:
    info = get_onnx_info(artifacts.decoder_onnx)
    assert isinstance(info, OnnxInfo)
    assert info.opset == DEFAULT_OPSET
    vocab = infer_vocab_size(artifacts.decoder)
    assert [(v.name, v.dtype, v.dims) for v in info.inputs] == [
        ("input_ids", "int64", ("batch", "sequence"))
    ]
    assert [(v.name, v.dtype, v.dims) for v in info.outputs] == [
        ("logits", "float", ("batch", "sequence", vocab))
    ]
    assert info.node_count > 10
    assert info.external_data_files == ()
    # every weight is stored once (a few derived constants may be added by the exporter)
    weights = sum(p.numel() * p.element_size() for p in artifacts.decoder.parameters())
    assert weights <= info.initializer_bytes < 1.5 * weights + 100_000


def test_transformers_model_gets_an_attention_mask_input(artifacts: Artifacts) -> None:
    info = get_onnx_info(artifacts.llama_legacy)
    assert [v.name for v in info.inputs] == ["input_ids", "attention_mask"]
    assert all(v.dims == ("batch", "sequence") for v in info.inputs)


def test_verification_report_of_a_good_export(artifacts: Artifacts) -> None:
    report = verify_onnx(artifacts.decoder_onnx, artifacts.decoder)
    assert isinstance(report, OnnxVerification)
    assert report.passed, report.summary()
    assert report.checker_ok
    assert report.error is None
    assert 0.0 <= report.max_abs <= ONNX_ATOL
    assert report.mismatch_fraction == 0.0
    assert (
        report.expected_shape == report.actual_shape == (2, 8, infer_vocab_size(artifacts.decoder))
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.passed = False  # type: ignore[misc]


def test_verification_at_other_shapes(artifacts: Artifacts) -> None:
    for shape in ((1, 5), (3, 11)):
        report = verify_onnx(
            artifacts.decoder_onnx, artifacts.decoder, _ids(artifacts.decoder, *shape)
        )
        assert report.passed, report.summary()
        assert report.actual_shape[:2] == shape


def test_verification_reports_a_mismatch_instead_of_raising(artifacts: Artifacts) -> None:
    other = build_model("decoder", seed=1)  # same architecture, different weights
    report = verify_onnx(artifacts.decoder_onnx, other)
    assert not report.passed
    assert report.checker_ok
    assert report.max_abs > 1e-3
    assert 0.0 < report.mismatch_fraction <= 1.0
    assert "FAILED" in report.summary()


def test_verification_of_a_corrupt_file(artifacts: Artifacts, tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a protobuf")
    report = verify_onnx(bad, artifacts.decoder)
    assert not report.passed
    assert not report.checker_ok
    assert report.error
    assert math.isnan(report.max_abs)


def test_legacy_exporter_on_a_transformers_model(artifacts: Artifacts) -> None:
    model = artifacts.llama
    assert verify_onnx(artifacts.llama_legacy, model).passed
    # with the explicit attention mask, transformers' graph stays dynamic under legacy too
    report = verify_onnx(artifacts.llama_legacy, model, _ids(model, 3, 11))
    assert report.passed, report.summary()


class _MHADecoder(nn.Module):
    """nn.MultiheadAttention with a causal mask built from the sequence length."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 40)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        seq = x.size(1)
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)
        out, _ = self.attn(x, x, x, attn_mask=mask, need_weights=False)
        return self.head(x + out)


def test_legacy_exporter_says_when_it_baked_in_the_shape(tmp_path: Path) -> None:
    model = _MHADecoder().eval()
    ids = torch.arange(16).reshape(2, 8) % 40
    with pytest.warns(LegacyTraceWarning, match=r"traced shape \(2, 8\)"):
        path = export_to_onnx(model, tmp_path / "mha.onnx", dynamo=False, example_inputs=ids)
    assert verify_onnx(path, model, ids).passed
    other = verify_onnx(path, model, torch.arange(15).reshape(3, 5) % 40)
    assert not other.passed
    assert other.error is not None  # onnxruntime's Reshape error, reported, not raised


def test_external_data_is_written_beside_the_file(artifacts: Artifacts, tmp_path: Path) -> None:
    path = export_to_onnx(artifacts.llama, tmp_path / "ext.onnx", dynamo=False, external_data=True)
    info = get_onnx_info(path)
    assert info.external_data_files
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["ext.onnx", "ext.onnx.manifest.json", *info.external_data_files]
    )
    weights = sum(p.numel() * p.element_size() for p in artifacts.llama.parameters())
    assert info.initializer_bytes >= weights * 0.9
    assert path.stat().st_size < weights / 2  # the weights are not inside the .onnx
    assert verify_onnx(path, artifacts.llama).passed


def test_export_to_onnx_equals_the_registered_target(artifacts: Artifacts, tmp_path: Path) -> None:
    path = exportlm.export_model("onnx", artifacts.llama, tmp_path / "t.onnx", dynamo=False)
    ids = _ids(artifacts.llama, 2, 8)
    a = exportlm.load_exported("onnx", path)(ids)
    b = exportlm.load_exported("onnx", artifacts.llama_legacy)(ids)
    # Exact: both artifacts come from the same exporter with the same options (one
    # graph), run by one onnxruntime in one process on the same inputs.
    torch.testing.assert_close(a, b, atol=0.0, rtol=0.0)


def test_explicit_attention_mask_in_example_inputs(artifacts: Artifacts, tmp_path: Path) -> None:
    ids = _ids(artifacts.llama, 2, 6)
    mask = torch.ones_like(ids)
    path = export_to_onnx(
        artifacts.llama, tmp_path / "m.onnx", dynamo=False, example_inputs=(ids, mask)
    )
    assert verify_onnx(path, artifacts.llama, ids).passed


def test_attention_mask_true_on_a_model_without_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(exportlm.InvalidModelError, match="attention_mask"):
        export_to_onnx(_MHADecoder(), tmp_path / "x.onnx", attention_mask=True)
    assert not any(tmp_path.iterdir())


def test_onnxruntime_threads_follow_torch_unless_given(artifacts: Artifacts) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        session = load_onnx(artifacts.decoder_onnx).session
        assert session.get_session_options().intra_op_num_threads == 1
        explicit = load_onnx(artifacts.decoder_onnx, intra_op_num_threads=2).session
        assert explicit.get_session_options().intra_op_num_threads == 2
    finally:
        torch.set_num_threads(before)


def test_stable_api_is_importable_from_exportlm_export() -> None:
    import exportlm.export
    import exportlm.export.onnx

    for name in ("export_to_onnx", "verify_onnx", "get_onnx_info", "build_onnx_exporter"):
        assert name in exportlm.export.__all__
        assert getattr(exportlm.export, name) is getattr(exportlm.export.onnx, name)


def test_build_onnx_exporter_is_the_registered_declared_target() -> None:
    from exportlm.export import (
        EXPORT_REGISTRY,
        RUNTIME_REGISTRY,
        build_onnx_exporter,
        ensure_exporters_registered,
        get_target_info,
    )

    ensure_exporters_registered()
    factory = build_onnx_exporter()
    assert EXPORT_REGISTRY.get("onnx") is factory
    info = get_target_info(factory)
    assert (info.name, info.runtime, info.suffix) == ("onnx", "onnx", ".onnx")
    assert RUNTIME_REGISTRY.get(info.runtime) is load_onnx
