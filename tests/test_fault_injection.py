"""Fault injection: an export that fails or is killed at any publishing step, or races another.

For every built-in target (onnx with external data, torchscript, torch_export,
hf_checkpoint) the invariant of all-or-nothing writes is checked through the public
API: after a failure (an exception at step k) or a crash (SIGKILL at step k) the path
holds the old artifact or the new one, loadable, with the logits of the model that
wrote it; the next export leaves no leftover; two concurrent writers both return or
one raises, and the final artifact verifies against its manifest.

Steps are observed with :func:`exportlm.atomic.publish_steps`; crashes happen in a
forked child (no second interpreter start: torch is already imported).
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from exportlm.atomic import publish_steps
from exportlm.errors import ExportFailedError
from exportlm.export import export_model, load_exported
from exportlm.export.manifest import verify_artifact
from exportlm.models import DecoderConfig, DecoderModel, tiny_hf_model

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="SIGKILL, fork and flock: the Linux guarantees"
)


class _Boom(RuntimeError):
    """The injected failure."""


def _raised_boom(excinfo: pytest.ExceptionInfo[BaseException]) -> bool:
    """The injected failure surfaced, as itself or chained under an exportlm error."""
    err: BaseException | None = excinfo.value
    while err is not None:
        if isinstance(err, _Boom):
            return True
        err = err.__cause__ or err.__context__
    return False


class _TinyLM(nn.Module):
    """Embedding + linear head: the legacy ONNX exporter takes it in ~0.3 s."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(input_ids)))


@dataclass(frozen=True)
class _Case:
    target: str
    name: str  # the artifact's file or directory name
    build: Callable[[int], nn.Module]
    options: dict[str, Any]
    ids: torch.Tensor
    atol: float


def _decoder(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return DecoderModel(DecoderConfig(hidden_size=32, intermediate_size=64, num_layers=1)).eval()


def _llama(seed: int) -> nn.Module:
    return tiny_hf_model("llama", seed=seed, num_hidden_layers=1)


_IDS = torch.tensor([[1, 5, 7, 2], [3, 3, 9, 4]])
CASES = {
    "onnx": _Case("onnx", "m.onnx", _TinyLM, {"dynamo": False, "external_data": True}, _IDS, 1e-4),
    "torchscript": _Case("torchscript", "m.pt", _decoder, {}, _IDS, 1e-5),
    "torch_export": _Case("torch_export", "m.pt2", _decoder, {}, _IDS, 1e-5),
    "hf_checkpoint": _Case("hf_checkpoint", "ckpt", _llama, {"overwrite": True}, _IDS, 1e-4),
}


@pytest.fixture(autouse=True)
def _own_key(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    key = tmp_path_factory.getbasetemp() / "exportlm-key" / "key"
    monkeypatch.setenv("EXPORTLM_KEY_FILE", str(key))


def _export(case: _Case, model: nn.Module, out: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return export_model(case.target, model, out, **case.options)


def _logits(case: _Case, path: Path) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a missing manifest warns; the files still load
        # trust=True: a crash between artifact and manifest leaves no manifest to vouch
        return torch.as_tensor(load_exported(case.target, path, trust=True)(case.ids)).float()


def _eager(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    from exportlm.export import ExportCacheWrapper

    with torch.no_grad():
        return ExportCacheWrapper(model).eval()(ids).float()


def _matches(actual: torch.Tensor, expected: torch.Tensor, atol: float) -> bool:
    return actual.shape == expected.shape and bool(
        torch.allclose(actual, expected, atol=atol, rtol=1e-4)
    )


def _assert_old_or_new(case: _Case, out: Path, old: nn.Module | None, new: nn.Module) -> str:
    """The path holds ``old`` (or nothing, when there was none) or ``new``; which one."""
    if not out.exists():
        assert old is None, f"{out} vanished: neither the old artifact nor the new one"
        return "none"
    got = _logits(case, out)
    if _matches(got, _eager(new, case.ids), case.atol):
        return "new"
    assert old is not None, f"{out} holds logits of another model than the new one"
    assert _matches(got, _eager(old, case.ids), case.atol), (
        f"{out} holds logits of neither the old nor the new model"
    )
    return "old"


def _expected_listing(case: _Case, root: Path) -> list[str]:
    names = (
        [case.name] if case.target == "hf_checkpoint" else [case.name, f"{case.name}.manifest.json"]
    )
    if case.target == "onnx":
        names += [p.name for p in root.glob(f"{case.name}.*.data")]
    return sorted(names)


def _assert_clean_after_next_export(case: _Case, out: Path, model: nn.Module) -> None:
    _export(case, model, out)
    verify_artifact(out)
    assert sorted(p.name for p in out.parent.iterdir()) == _expected_listing(case, out.parent)
    if case.target == "onnx":
        assert len(list(out.parent.glob(f"{case.name}.*.data"))) == 1  # old data pruned
    assert _matches(_logits(case, out), _eager(model, case.ids), case.atol)


def _steps(case: _Case, out: Path, model: nn.Module) -> list[str]:
    seen: list[str] = []
    with publish_steps(lambda step, path: seen.append(f"{step}:{path.name}")):
        _export(case, model, out)
    return seen


def _probe_steps(case: _Case, root: Path) -> list[str]:
    """The publishing steps of an export over an existing artifact, from a scratch directory."""
    probe = root / "probe" / case.name
    _export(case, case.build(0), probe)
    return _steps(case, probe, case.build(1))


def _fail_at(k: int) -> Callable[[str, Path], None]:
    count = iter(range(10**6))

    def observer(step: str, path: Path) -> None:
        if next(count) == k:
            raise _Boom(f"injected failure at step {k} ({step} {path.name})")

    return observer


@pytest.mark.parametrize("target", sorted(CASES))
def test_a_failure_at_every_publishing_step_leaves_old_or_new(target: str, tmp_path: Path) -> None:
    case = CASES[target]
    steps = _probe_steps(case, tmp_path)
    assert len(steps) >= 3, steps  # staged, hook (manifest), at least one rename
    old, new = case.build(0), case.build(1)
    out = tmp_path / "out" / case.name
    _export(case, old, out)
    outcomes = []
    for k in range(len(steps)):
        with publish_steps(_fail_at(k)), pytest.raises(Exception) as excinfo:
            _export(case, new, out)
        assert _raised_boom(excinfo)
        outcomes.append(_assert_old_or_new(case, out, old, new))
    assert outcomes[0] == "old"  # failing before any rename keeps the old artifact whole
    _assert_clean_after_next_export(case, out, new)


@pytest.mark.parametrize("target", sorted(CASES))
def test_a_failure_of_the_first_export_leaves_nothing(target: str, tmp_path: Path) -> None:
    case = CASES[target]
    out = tmp_path / case.name
    with publish_steps(_fail_at(0)), pytest.raises(Exception) as excinfo:
        _export(case, case.build(0), out)
    assert _raised_boom(excinfo)
    assert list(tmp_path.iterdir()) == []


def test_a_failing_os_replace_keeps_the_old_onnx_graph_with_its_own_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = CASES["onnx"]
    old, new = case.build(0), case.build(1)
    out = tmp_path / case.name
    _export(case, old, out)
    real = os.replace

    def replace_data_only(src: Any, dst: Any) -> None:
        if str(dst).endswith(case.name):  # the graph: the publish fails here
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace_data_only)
    with pytest.raises((OSError, ExportFailedError), match="No space left"):
        _export(case, new, out)
    monkeypatch.setattr(os, "replace", real)
    # the new data file was published, but the old graph names its own data by content
    assert len(list(tmp_path.glob("m.onnx.*.data"))) == 2
    assert _assert_old_or_new(case, out, old, new) == "old"
    _assert_clean_after_next_export(case, out, new)


def _in_child(body: Callable[[], None]) -> int:
    """Run ``body`` in a forked child; its wait status."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            torch.set_num_threads(1)
            body()
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def _kill_at(k: int) -> Callable[[str, Path], None]:
    count = iter(range(10**6))

    def observer(step: str, path: Path) -> None:
        if next(count) == k:
            os.kill(os.getpid(), signal.SIGKILL)

    return observer


@pytest.mark.parametrize("target", sorted(CASES))
def test_sigkill_at_every_publishing_step_leaves_old_or_new(target: str, tmp_path: Path) -> None:
    case = CASES[target]
    steps = _probe_steps(case, tmp_path)
    old, new = case.build(0), case.build(1)
    out = tmp_path / "out" / case.name
    _export(case, old, out)
    for k in range(len(steps)):

        def killed_export(k: int = k) -> None:
            with publish_steps(_kill_at(k)):
                _export(case, new, out)

        status = _in_child(killed_export)
        assert os.WIFSIGNALED(status), (k, steps)
        assert os.WTERMSIG(status) == signal.SIGKILL, (k, steps)
        _assert_old_or_new(case, out, old, new)
    leftovers = [p.name for p in out.parent.iterdir() if p.name.endswith(".tmp")]
    assert leftovers  # a killed writer cannot clean up after itself ...
    _assert_clean_after_next_export(case, out, new)  # ... the next export does


@pytest.mark.parametrize("target", sorted(CASES))
def test_two_concurrent_writers_never_leave_a_broken_artifact(target: str, tmp_path: Path) -> None:
    case = CASES[target]
    models = [case.build(0), case.build(1)]
    out = tmp_path / case.name
    read, write = os.pipe()
    pids = []
    for model in models:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 2
            try:
                torch.set_num_threads(1)
                os.close(write)
                os.read(read, 1)  # start together
                _export(case, model, out)
                code = 0
            except Exception:
                code = 1
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(read)
    os.write(write, b"go")
    os.close(write)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    assert set(codes) <= {0, 1}, codes  # each writer returns or raises an exportlm error
    assert 0 in codes, codes  # and one of them wins
    verify_artifact(out)
    got = _logits(case, out)
    assert any(_matches(got, _eager(m, case.ids), case.atol) for m in models)
    assert sorted(p.name for p in tmp_path.iterdir()) == _expected_listing(case, tmp_path)
