"""Every built-in export target x one toy model of each kind, through the public API.

Each (target, model) pair is exported once per module (``exported`` fixture) and the
artifact is then checked several ways: roundtrip logits in the target's own runtime
at the traced shape and at other batch/sequence lengths, and the model left exactly
as it was (weights, experts implementation, train/eval flags), also by an export
that fails.

The models are one of each kind the export code treats differently (``MATRIX_MODELS``):
exportlm's own module, a transformers model with a tied head, a transformers MoE
whose experts kernel is switched for the export, and every pair a family declares
it fails. The full target x family matrix of roundtrip and dynamic-shape checks is
the conformance suite's (``roundtrip_logits`` and ``dynamic_shapes`` items, run by
``make conformance``); repeating it here cost a 6-14 CPU-s ONNX export per family.

A pair the model family declares it fails (``model_expected_failures``: Llama4's
complex-valued rotary embedding has no ONNX translation; DBRX's experts loop over
the experts a batch hits and have no traceable implementation to switch to) is a
strict expected failure with the family's own reason: it must still fail.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

import exportlm
from exportlm.export import get_target_info, infer_vocab_size, make_input_ids
from exportlm.models import (
    MODEL_REGISTRY,
    build_model,
    ensure_models_registered,
    model_expected_failures,
    model_failure_causes,
)

BUILTIN_MODELS = (
    "decoder",
    "decoder_tied",
    "iterable_moe",
    "llama",
    "llama_tied",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "gpt_oss",
    "llama4",
    "dbrx",
)
TARGETS = ("onnx", "torchscript", "torch_export")
#: The conformance column each target's default export is: torchscript traces by default.
COLUMNS = {"onnx": "onnx", "torchscript": "torchscript:trace", "torch_export": "torch_export"}

# One TorchScriptDeprecationWarning per export is the target's contract (tested below);
# in the matrix it is expected, not news.
pytestmark = pytest.mark.filterwarnings(
    "ignore::exportlm.export.torchscript.TorchScriptDeprecationWarning"
)
SUFFIX = {"onnx": ".onnx", "torchscript": ".pt", "torch_export": ".pt2"}


def declared_failure(target: str, name: str) -> str | None:
    """The reason family ``name`` declares for failing ``target``'s roundtrip, or ``None``.

    Patterns use the conformance suite's syntax: ``*`` and ``?`` are the only
    wildcards, brackets are literal.
    """
    item = f"roundtrip_logits[{COLUMNS[target]}-{name}-cpu]"
    capture = get_target_info(target).capture_of(COLUMNS[target].partition(":")[2] or None)
    for cause in model_failure_causes(name):
        if cause.fails_under(capture):
            return cause.reason
    for pattern, reason in model_expected_failures(name).items():
        if _matches(pattern, item):
            return reason
    return None


def _matches(pattern: str, item_id: str) -> bool:
    """``pattern`` (a bare check id, or a pattern over item ids) covers ``item_id``."""
    if "[" not in pattern:
        return item_id.startswith(f"{pattern}[")
    body = re.escape(pattern).replace(r"\*", ".*").replace(r"\?", ".")
    return re.fullmatch(body, item_id) is not None


def _pair(target: str, name: str) -> object:
    marks = [pytest.mark.xdist_group(f"export-{target}-{name}")]
    reason = declared_failure(target, name)
    if reason is not None:
        marks.append(pytest.mark.xfail(strict=True, reason=f"declared by {name!r}: {reason}"))
    return pytest.param(target, name, marks=marks)


#: One family of each kind the export treats differently: exportlm's own module, a
#: transformers model with a tied head, a transformers MoE (experts kernel switched).
MATRIX_MODELS = ("decoder", "llama_tied", "qwen3_moe")


def matrix(target: str) -> list[str]:
    """The families checked for ``target``: ``MATRIX_MODELS`` and every declared failure
    but Llama4's ONNX one (a 12 CPU-s export that proves what DBRX's failure proves here;
    its strict xfail stays in the conformance suite)."""
    declared = [n for n in BUILTIN_MODELS if declared_failure(target, n) is not None]
    return [*MATRIX_MODELS, *(n for n in declared if n != "llama4")]


# Tests of one (target, model) pair share one export; under `--dist loadgroup` they
# run on the same xdist worker so the module-scoped cache is hit instead of re-exporting.
PAIRS = [_pair(target, name) for target in TARGETS for name in matrix(target)]
# Every pair, declared failures included: a failing export must leave the model as it was too.
ALL_PAIRS = [
    pytest.param(target, name, marks=pytest.mark.xdist_group(f"export-{target}-{name}"))
    for target in TARGETS
    for name in matrix(target)
]
TRACED = (2, 8)
OTHER_SHAPES = ((1, 5), (3, 11))


@dataclass
class Exported:
    model: nn.Module
    path: Path | None  # None: the export failed with ``error``
    error: exportlm.ExportFailedError | None
    state_before: dict[str, torch.Tensor]
    experts_before: list[dict[str, str | None]]
    training_before: list[bool]


def experts_implementations(model: nn.Module) -> list[dict[str, str | None]]:
    """transformers' own snapshot of the MoE kernel choice (empty for non-transformers models)."""
    get = getattr(model, "get_experts_implementation", None)
    return [dict(get())] if callable(get) else []


def _eager(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def _vocab(model: nn.Module) -> int:
    return infer_vocab_size(model)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Exported]:
    cache: dict[tuple[str, str], Exported] = {}
    root = tmp_path_factory.mktemp("targets")  # one directory per target below

    def get(target: str, name: str) -> Exported:
        if (target, name) not in cache:
            model = build_model(name, seed=0)
            state = {k: v.clone() for k, v in model.state_dict().items()}
            experts = experts_implementations(model)
            training = [m.training for m in model.modules()]
            path: Path | None = None
            error: exportlm.ExportFailedError | None = None
            try:
                path = exportlm.export_model(
                    target, model, root / target / f"{name}{SUFFIX[target]}"
                )
            except exportlm.ExportFailedError as err:
                error = err
            cache[target, name] = Exported(model, path, error, state, experts, training)
        return cache[target, name]

    return get


def test_every_builtin_model_family_is_in_the_matrix() -> None:
    """A built-in family added to exportlm must be listed here, its declared failures checked
    (and no name may be stale)."""
    ensure_models_registered()
    builtin = {entry.name for entry in MODEL_REGISTRY.entries() if entry.builtin}
    assert not builtin - set(BUILTIN_MODELS), "built-in families missing from BUILTIN_MODELS"
    assert not set(BUILTIN_MODELS) - builtin, "BUILTIN_MODELS names a family that is not built in"


@pytest.mark.parametrize(("target", "name"), PAIRS)
def test_roundtrip_logits_at_traced_and_other_shapes(
    exported: Callable[[str, str], Exported], target: str, name: str
) -> None:
    record = exported(target, name)
    info = get_target_info(target)
    if record.error is not None:
        raise record.error
    assert record.path is not None
    assert record.path.is_file()
    assert record.path.suffix == SUFFIX[target]
    runtime = exportlm.load_exported(target, record.path)
    shapes = (TRACED, *OTHER_SHAPES) if info.has("dynamic_shapes") else (TRACED,)
    for batch, seq in shapes:
        ids = make_input_ids(_vocab(record.model), batch, seq, seed=1)
        actual = runtime(ids)
        assert actual.shape == (batch, seq, _vocab(record.model))
        expected = _eager(record.model, ids)
        torch.testing.assert_close(actual, expected, atol=info.atol, rtol=info.rtol)


@pytest.mark.parametrize(("target", "name"), ALL_PAIRS)
def test_export_leaves_the_model_unchanged(
    exported: Callable[[str, str], Exported], target: str, name: str
) -> None:
    record = exported(target, name)
    after = record.model.state_dict()
    assert after.keys() == record.state_before.keys()
    for key, before in record.state_before.items():
        assert torch.equal(after[key], before), key
    assert experts_implementations(record.model) == record.experts_before
    assert [m.training for m in record.model.modules()] == record.training_before


def test_moe_experts_kernel_is_switched_only_during_export(tmp_path: Path) -> None:
    model = build_model("mixtral")
    model.train()
    seen: list[list[dict[str, str | None]]] = []
    model.lm_head.register_forward_pre_hook(
        lambda mod, args: seen.append(experts_implementations(model))
    )
    exportlm.export_model("torchscript", model, tmp_path / "m.pt")
    assert seen, "the forward never ran during export"
    assert seen[0] == [{"": "batched_mm"}] * len(seen[0])
    assert experts_implementations(model)[0] == {"": "grouped_mm"}
    assert all(m.training for m in model.modules())


class _UserWrapper(nn.Module):
    """A user's own module around a transformers MoE model."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.inner(input_ids, use_cache=False).logits
        return logits


def test_moe_experts_inside_a_plain_module_are_switched_and_restored(tmp_path: Path) -> None:
    inner = build_model("mixtral")
    seen: list[list[dict[str, str | None]]] = []
    inner.lm_head.register_forward_pre_hook(
        lambda mod, args: seen.append(experts_implementations(inner))
    )
    path = exportlm.export_model("torch_export", _UserWrapper(inner), tmp_path / "w.pt2")
    assert seen, "the forward never ran during export"
    assert all(snapshot == [{"": "batched_mm"}] for snapshot in seen), seen
    assert experts_implementations(inner) == [{"": "grouped_mm"}]
    ids = make_input_ids(_vocab(inner), 2, 8, seed=1)
    info = get_target_info("torch_export")
    torch.testing.assert_close(
        exportlm.load_exported("torch_export", path)(ids),
        _eager(inner, ids),
        atol=info.atol,
        rtol=info.rtol,
    )


class _ObjectOutput(nn.Module):
    """A model that is none of ours: forward returns an object with ``.logits``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50)

    def forward(self, input_ids: torch.Tensor) -> object:
        from transformers.modeling_outputs import CausalLMOutput

        return CausalLMOutput(logits=self.head(torch.tanh(self.embed(input_ids))))


@pytest.mark.parametrize("target", TARGETS)
def test_any_module_with_logits_output_exports(tmp_path: Path, target: str) -> None:
    model = _ObjectOutput().eval()
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    path = exportlm.export_model(target, model, tmp_path / f"m{SUFFIX[target]}", example_inputs=ids)
    runtime = exportlm.load_exported(target, path)
    info = get_target_info(target)
    other = torch.tensor([[9, 8, 7], [6, 5, 4], [3, 2, 1]])
    torch.testing.assert_close(
        runtime(other), model(other).logits.detach(), atol=info.atol, rtol=info.rtol
    )


def test_torch_export_static_refuses_other_shapes(tmp_path: Path) -> None:
    model = build_model("decoder")
    path = exportlm.export_model("torch_export", model, tmp_path / "s.pt2", dynamic=False)
    runtime = exportlm.load_exported("torch_export", path)
    ids = make_input_ids(_vocab(model), *TRACED, seed=1)
    torch.testing.assert_close(runtime(ids), _eager(model, ids), atol=1e-5, rtol=1e-5)
    with pytest.raises(Exception, match=r"(?i)shape|guard|expected"):
        runtime(make_input_ids(_vocab(model), 3, 8, seed=1))


def test_torch_export_artifact_loads_without_transformers(
    exported: Callable[[str, str], Exported], tmp_path: Path
) -> None:
    """A .pt2 of a transformers MoE model runs in a process that never imports transformers."""
    path = exported("torch_export", "qwen3_moe").path
    code = (
        "import sys, torch\n"
        f"m = torch.export.load(open({str(path)!r}, 'rb')).module()\n"
        "print(tuple(m(torch.zeros(2, 8, dtype=torch.long)).shape), 'transformers' in sys.modules)\n"
    )
    assert _last_word_printed(code) == "False"


def _last_word_printed(code: str) -> str:
    """The last word ``code`` prints, run in a fresh interpreter (which must exit 0)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()[-1]


def test_onnx_export_of_a_model_of_ones_own_leaves_transformers_modeling_unimported(
    tmp_path: Path,
) -> None:
    """Deciding whether the model takes an attention mask asks transformers only when a
    transformers model can exist: importing its modeling code costs a fresh process 1.4 s.
    The top-level package is imported first, as ``exportlm.models`` imports it."""
    code = (
        "import sys, torch, transformers\n"
        "import exportlm\n"
        "class LM(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.embed, self.head = torch.nn.Embedding(40, 8), torch.nn.Linear(8, 40)\n"
        "    def forward(self, input_ids):\n"
        "        return self.head(self.embed(input_ids))\n"
        f"exportlm.export_model('onnx', LM().eval(), {str(tmp_path / 'lm.onnx')!r}, dynamo=False)\n"
        "print('transformers.modeling_utils' in sys.modules)\n"
    )
    assert _last_word_printed(code) == "False"
    assert (tmp_path / "lm.onnx").stat().st_size > 0


class _Scriptable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 8)
        self.head = nn.Linear(8, 40)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


def test_torchscript_script_method_exports_a_scriptable_model(tmp_path: Path) -> None:
    model = _Scriptable().eval()
    with pytest.warns(FutureWarning, match="deprecated") as record:
        path = exportlm.export_model("torchscript", model, tmp_path / "s.pt", method="script")
    assert len([w for w in record if "torch.jit" in str(w.message)]) == 1
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(
        exportlm.load_exported("torchscript", path)(ids), model(ids).detach()
    )


@pytest.mark.parametrize("name", ["decoder", "llama"])
def test_torchscript_script_fails_on_builtin_models_as_declared(tmp_path: Path, name: str) -> None:
    with pytest.raises(exportlm.ExportFailedError, match="torchscript export"):
        exportlm.export_model("torchscript", build_model(name), tmp_path / "x.pt", method="script")
    assert not any(tmp_path.iterdir())
    assert any(c.fails_under("torchscript-script") for c in model_failure_causes(name))


def test_script_failures_are_declared_by_each_family_not_by_the_target() -> None:
    """A target knows nothing of toy models: each family declares what it cannot do."""
    assert get_target_info("torchscript").expected_failures == {}
    assert get_target_info("torchscript").capture_of("script") == "torchscript-script"
    for name in BUILTIN_MODELS:
        causes = [c for c in model_failure_causes(name) if c.fails_under("torchscript-script")]
        assert causes, name
        assert {"roundtrip_logits", "dynamic_shapes"} <= set(causes[0].checks)
    assert set(get_target_info("torchscript").variants) == {"trace", "script"}
