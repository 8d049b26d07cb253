"""Without the ``onnx`` extra: exportlm imports, every other target works, ``onnx`` says what to install.

Each test runs a fresh interpreter in which ``onnx``, ``onnxruntime`` and
``onnxscript`` cannot be imported (``sys.modules[name] = None`` before anything
else is imported), as in an environment installed without ``exportlm[onnx]``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

_BLOCK = """
import sys
for _name in ("onnx", "onnxruntime", "onnxscript"):
    sys.modules[_name] = None  # "import onnx" now raises ImportError
"""


def _run_without_onnx(tmp_path: Path, body: str) -> dict[str, Any]:
    """Run ``body`` with the ONNX packages blocked; it must print one JSON line last."""
    script = _BLOCK + textwrap.dedent(body)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_onnx_stays_listed_and_other_targets_roundtrip(tmp_path: Path) -> None:
    result = _run_without_onnx(
        tmp_path,
        """
        import contextlib, io, json, warnings
        import torch
        import exportlm
        from exportlm.cli import main
        from exportlm.export import (
            EXPORT_REGISTRY, ensure_exporters_registered, extract_logits, get_target_info,
            infer_vocab_size, make_input_ids,
        )
        from exportlm.models import build_model

        warnings.simplefilter("ignore")
        ensure_exporters_registered()
        listing = io.StringIO()
        with contextlib.redirect_stdout(listing):
            main(["list", "--json"])
        errors = {}
        for target, name, suffix in [
            ("torchscript", "decoder", ".pt"),
            ("torch_export", "decoder", ".pt2"),
            ("hf_checkpoint", "llama", ""),
        ]:
            model = build_model(name, seed=0)
            path = exportlm.export_model(target, model, f"{target}{suffix}")
            ids = make_input_ids(infer_vocab_size(model), 2, 8, seed=1)
            actual = exportlm.load_exported(target, path)(ids)
            with torch.no_grad():
                expected = extract_logits(model(ids))
            info = get_target_info(target)  # each target's declared tolerance
            try:
                torch.testing.assert_close(actual, expected, atol=info.atol, rtol=info.rtol)
            except AssertionError as err:
                errors[target] = str(err)
        print(json.dumps({
            "registered": EXPORT_REGISTRY.names(),
            "failed": sorted(EXPORT_REGISTRY.failed()),
            "listing": listing.getvalue(),
            "roundtrip_errors": errors,
        }))
        """,
    )
    assert "onnx" in result["registered"]
    assert result["failed"] == []
    assert '"onnx"' in result["listing"], result["listing"]
    assert result["roundtrip_errors"] == {}


def test_onnx_export_and_load_name_the_missing_packages(tmp_path: Path) -> None:
    result = _run_without_onnx(
        tmp_path,
        """
        import json, pathlib
        import exportlm
        from exportlm.errors import ExportLMError, MissingDependencyError
        from exportlm.export import export_to_onnx, get_onnx_info, verify_onnx
        from exportlm.models import build_model

        def error_of(call):
            try:
                call()
            except MissingDependencyError as err:
                return {
                    "message": str(err),
                    "modules": err.modules,
                    "name": err.name,
                    "import_error": isinstance(err, ImportError),
                    "exportlm_error": isinstance(err, ExportLMError),
                }
            return None

        model = build_model("decoder")
        pathlib.Path("old.onnx").write_bytes(b"previous artifact")
        result = {
            "dynamo": error_of(lambda: exportlm.export_model("onnx", model, "m.onnx")),
            "legacy": error_of(lambda: exportlm.export_model("onnx", model, "old.onnx", dynamo=False)),
            "stable": error_of(lambda: export_to_onnx(model, "s.onnx")),
            "load": error_of(lambda: exportlm.load_exported("onnx", "old.onnx")),
            "info": error_of(lambda: get_onnx_info("old.onnx")),
            "verify": error_of(lambda: verify_onnx("old.onnx", model)),
            "files": sorted(p.name for p in pathlib.Path(".").iterdir()),
            "old": pathlib.Path("old.onnx").read_text(),
        }
        print(json.dumps(result))
        """,
    )
    expected_modules = {
        "dynamo": ["onnx", "onnxscript"],
        "legacy": ["onnx"],
        "stable": ["onnx", "onnxscript"],
        "load": ["onnxruntime"],
        "info": ["onnx"],
        "verify": ["onnx", "onnxruntime"],
    }
    for case, modules in expected_modules.items():
        error = result[case]
        assert error is not None, f"{case}: no MissingDependencyError"
        assert error["modules"] == modules, case
        assert error["name"] == modules[0], case
        assert error["import_error"], case
        assert error["exportlm_error"], case
        assert "pip install 'exportlm[onnx]'" in error["message"], error["message"]
        assert all(m in error["message"] for m in modules), error["message"]
    assert "'onnx' target" in result["dynamo"]["message"]
    assert "'onnx' runtime" in result["load"]["message"]
    # Refused before anything was written: no new file, the old artifact intact.
    assert result["files"] == ["old.onnx"]
    assert result["old"] == "previous artifact"


def test_imports_do_not_load_onnx_packages(tmp_path: Path) -> None:
    """Importing the library (or the checks) never reaches for an ONNX package.

    One interpreter imports the three in turn: each import runs the whole graph of
    modules it reaches first, and any ``import onnx`` in it raises, so one process
    shows what three would.
    """
    result = _run_without_onnx(
        tmp_path,
        """
        import importlib, json
        for module in ("exportlm", "exportlm.export", "pytest_exportcheck.checks"):
            importlib.import_module(module)
        print(json.dumps({"ok": True}))
        """,
    )
    assert result == {"ok": True}
