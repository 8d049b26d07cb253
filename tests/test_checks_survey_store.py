"""The survey's calibrated states, shared through ``CheckServices.shared_dir``.

One services object calibrates and publishes; another (standing for another xdist
worker, or the next run) reads the states back instead of calibrating, and its
survey exports the same tensors. A state that does not verify is calibrated again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_exportcheck.checks import _survey_quantize as survey_module
from pytest_exportcheck.checks._services import CheckServices
from pytest_exportcheck.checks._survey import Survey, registry_state, survey_of

MODELS = ("llama", "decoder_tied")
#: Fast recipes: static FP8 calibrates activations (a forward), INT8 weight-only does not.
RECIPES = ("fp8", "int8_wo")


def _survey(shared: Path | None) -> Survey:
    return survey_of(MODELS, 0, RECIPES, services=CheckServices(shared_dir=shared))


def _exact(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor


def _same_exports(a: Survey, b: Survey) -> None:
    # Exact on purpose: the exporters quantize restored weights and copy restored
    # scales (no forward pass, no matmul), so a faithful restore gives the same bits.
    assert [(q.model_name, q.recipe) for q in a.quantized] == [
        (q.model_name, q.recipe) for q in b.quantized
    ]
    for x, y in zip(a.quantized, b.quantized, strict=True):
        assert sorted(x.tensors) == sorted(y.tensors)
        for name in x.tensors:
            assert torch.equal(_exact(x.tensors[name]), _exact(y.tensors[name])), name
        assert [c.name for c in x.claims] == [c.name for c in y.claims]


@pytest.fixture
def calibrations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every data calibration the survey runs, as ``model/recipe`` (synthetic ones are not)."""
    seen: list[str] = []
    real = survey_module.quantize

    def counting(model: Any, recipe: Any, calibrate: Any = None, **kwargs: Any) -> Any:
        if calibrate is None:
            seen.append(f"{type(model).__name__}/{recipe}")
        return real(model, recipe, calibrate, **kwargs)

    monkeypatch.setattr(survey_module, "quantize", counting)
    return seen


def test_a_second_process_reads_the_calibrated_states(
    tmp_path: Path, calibrations: list[str]
) -> None:
    first = _survey(tmp_path)
    assert len(calibrations) == len(MODELS) * len(RECIPES)
    assert len(list((tmp_path / "calibrated").glob("*.json"))) == len(calibrations)
    calibrations.clear()
    second = _survey(tmp_path)
    assert calibrations == []
    _same_exports(first, second)


def test_without_a_shared_dir_each_services_calibrates(
    tmp_path: Path, calibrations: list[str]
) -> None:
    services = CheckServices()
    survey_of(MODELS, 0, RECIPES, services=services)
    survey_of(MODELS, 0, RECIPES, services=services)  # remembered by the same services
    assert len(calibrations) == len(MODELS) * len(RECIPES)
    _survey(None)
    assert len(calibrations) == 2 * len(MODELS) * len(RECIPES)


def test_a_changed_or_moved_state_is_calibrated_again(
    tmp_path: Path, calibrations: list[str]
) -> None:
    first = _survey(tmp_path)
    entries = sorted((tmp_path / "calibrated").glob("*.safetensors"))
    data = bytearray(entries[0].read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the stored state
    entries[0].chmod(0o644)
    entries[0].write_bytes(bytes(data))
    metas = sorted((tmp_path / "calibrated").glob("*.json"))
    metas[1].write_text(metas[2].read_text())  # another entry's signed JSON under this key
    calibrations.clear()
    second = _survey(tmp_path)
    assert len(calibrations) == 2
    _same_exports(first, second)


def test_the_memo_key_holds_the_registry_objects_not_their_ids() -> None:
    state = registry_state()
    assert state
    assert not any(isinstance(part, int) for entry in state for part in entry)
