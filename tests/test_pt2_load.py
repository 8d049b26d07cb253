"""The torch_export runtime's faster load yields the program torch.export.load yields."""

from __future__ import annotations

from pathlib import Path

import pytest
import sympy
import sympy.parsing.sympy_parser as sympy_parser
import torch

from exportlm.export.torch_export import export_torch_export, load_torch_export
from exportlm.models import build_model


@pytest.fixture(scope="module")
def llama_pt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    model = build_model("llama", seed=0)
    path = tmp_path_factory.mktemp("pt2") / "llama_kv.pt2"
    export_torch_export(model, path, kv_cache=True)
    return model, path


def test_loaded_program_is_the_one_torch_loads(llama_pt2: tuple[torch.nn.Module, Path]) -> None:
    _, path = llama_pt2
    runtime = load_torch_export(path)
    with open(path, "rb") as file:
        reference = torch.export.load(file).module()
    assert runtime.module.code == reference.code  # type: ignore[union-attr]
    ours = runtime.module.state_dict()  # type: ignore[union-attr]
    theirs = reference.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_loaded_program_generates_like_eager(llama_pt2: tuple[torch.nn.Module, Path]) -> None:
    model, path = llama_pt2
    ids = torch.tensor([[1, 5, 9, 2], [3, 3, 7, 4]])
    with torch.no_grad():
        expected = model(ids).logits
    logits = load_torch_export(path)(ids)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_load_leaves_sympy_and_torch_serde_as_they_were(
    llama_pt2: tuple[torch.nn.Module, Path],
) -> None:
    import typing

    import torch._export.serde.serialize as serialize

    parse_expr = sympy_parser.parse_expr
    load_torch_export(llama_pt2[1])
    assert sympy_parser.parse_expr is parse_expr
    assert serialize.typing is typing
    assert sympy.sympify("s0*2 + 1") == 2 * sympy.Symbol("s0") + 1
