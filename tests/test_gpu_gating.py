"""CUDA gating on a machine without CUDA: skips with a reason, failures when a device is required.

Every run plans cheap items (``registered``: no export; ``fp8_gemm``, which stops
before any work without CUDA, and whose cpu cell is no item: it runs on CUDA only), so the in-process runs take well under a second;
only the xdist runs start subprocesses: two runs, one without and one with
``--export-require-device``, each holding both kinds of item. They use one worker:
the gating is decided in the worker and reported through the controller, which
``-n 1`` proves as ``-n 2`` did, without a second worker that imports torch and
collects the suite for nothing. What needs a GPU (the items passing on
CUDA) is what ``benchmarks/gpu/check.sh`` runs; see docs/gpu.md.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

# In-process pytester runs drop the modules they imported when they end; import
# what the suite loads once here, so those runs reuse it (and its registries).
import exportlm.export
import exportlm.models
import exportlm.module_exporters  # noqa: F401
import pytest_exportcheck.checks  # noqa: F401
from pytest_exportcheck.checks import CatalogueError, CheckSpec
from pytest_exportcheck.session.environment._float32 import Float32Precision

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="these tests check the gating on a machine without CUDA"
)

NO_CUDA = "CUDA is not available on this machine (torch.cuda.is_available() is False)"
REQUIRED = "and --export-require-device is set"
#: The matrix's line for fp8_gemm's cpu cell: the check runs on CUDA devices only, so
#: that cell is no item, whatever the machine has.
FP8_GEMM_CPU = "  · not applicable: 1 (row, check) cell(s), 1 item(s) fewer*"


def _outcomes(result: pytest.RunResult) -> dict[str, int]:
    """The run's outcome counts; its warnings are not what these tests check (an in-process
    run warns that the plugin was imported before it could be rewritten)."""
    counts = result.parseoutcomes()
    return {key: n for key, n in counts.items() if key not in ("warning", "warnings")}


def test_cuda_items_skip_with_a_reason_naming_cuda(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(
        "--export-targets=torch_export",
        "--export-checks=registered",
        "--export-device=cpu,cuda",
        "--export-only",
        "-rs",
    )
    assert _outcomes(result) == {"passed": 2, "skipped": 1}, result.stdout.str()
    result.stdout.fnmatch_lines([f"SKIPPED*{NO_CUDA}*"])


def test_require_device_turns_the_cuda_items_into_failures(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(
        "--export-targets=torch_export",
        "--export-checks=registered",
        "--export-device=cpu,cuda",
        "--export-require-device",
        "--export-only",
        "-rf",
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert _outcomes(result) == {"passed": 2, "failed": 1}, result.stdout.str()
    result.stdout.fnmatch_lines(["*_ registered?torch_export-cuda? _*", f"{NO_CUDA}, {REQUIRED}"])


def test_a_target_without_cuda_is_a_counted_skip_that_says_why(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(
        "--export-targets=onnx", "--export-checks=registered", "--export-device=cuda", "-rs"
    )
    assert _outcomes(result) == {"passed": 1, "skipped": 1}, result.stdout.str()
    result.stdout.fnmatch_lines(["SKIPPED*'onnx' does not declare 'cuda'*onnxruntime-gpu*"])


def test_exporter_checks_declared_per_device_get_a_cuda_item(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(
        "--export-exporters=quant_linear",
        "--export-checks=mro_match,golden_checkpoint,golden_calibration,fp8_gemm",
        "--export-device=cpu,cuda",
        "--co",
        "-q",
    )
    ids = {line.split("::")[-1] for line in result.outlines if line.startswith("exportcheck::")}
    assert ids == {
        "mro_match[quant_linear]",
        "golden_checkpoint[quant_linear]",
        "golden_checkpoint[quant_linear-cuda]",
        "golden_calibration[quant_linear]",
        "golden_calibration[quant_linear-cuda]",
        "fp8_gemm[quant_linear-cuda]",  # its cpu cell cannot apply: no item
    }


def test_fp8_gemm_skips_without_cuda_and_fails_when_a_device_is_required(
    pytester: pytest.Pytester,
) -> None:
    args = ("--export-exporters=quant_linear", "--export-checks=fp8_gemm", "-m", "cuda")
    skipped = pytester.runpytest(*args, "--export-device=cpu,cuda", "-rs")
    assert _outcomes(skipped) == {"skipped": 1}, skipped.stdout.str()
    skipped.stdout.fnmatch_lines([FP8_GEMM_CPU, f"SKIPPED*{NO_CUDA}*"])
    required = pytester.runpytest(
        *args, "--export-device=cpu,cuda", "--export-require-device", "-rfs"
    )
    assert _outcomes(required) == {"failed": 1}, required.stdout.str()
    required.stdout.fnmatch_lines(["*_ fp8_gemm?quant_linear-cuda? _*", f"{NO_CUDA}, {REQUIRED}"])


def test_under_xdist_the_cuda_items_skip_or_fail_as_in_one_process(
    pytester: pytest.Pytester,
) -> None:
    """The runs above, under xdist: the target item and the exporter item each skip with
    their reason, and each fails under --export-require-device."""
    args = (
        "--export-targets=torch_export",
        "--export-exporters=quant_linear",
        "--export-checks=registered,fp8_gemm",
        "--export-device=cpu,cuda",
        "--export-only",
        "-n",
        "1",
    )
    skipped = pytester.runpytest(*args, "-rs")
    assert _outcomes(skipped) == {"passed": 2, "skipped": 2}, skipped.stdout.str()
    skipped.stdout.fnmatch_lines_random([f"SKIPPED*{NO_CUDA}*", FP8_GEMM_CPU])
    required = pytester.runpytest(*args, "--export-require-device", "-rfs")
    assert required.ret == pytest.ExitCode.TESTS_FAILED
    assert _outcomes(required) == {"passed": 2, "failed": 2}, required.stdout.str()
    required.stdout.fnmatch_lines_random(
        [
            "*_ registered?torch_export-cuda? _*",
            "*_ fp8_gemm?quant_linear-cuda? _*",
            f"{NO_CUDA}, {REQUIRED}",
        ]
    )


def test_only_exporter_checks_declare_per_device() -> None:
    with pytest.raises(CatalogueError, match="per_device=True is for scope='exporter'"):
        CheckSpec("x", "target", "a.b:c", per_device=True)


def test_the_header_says_what_happens_to_tf32(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(
        "--export-targets=torch_export", "--export-checks=registered", "--export-device=cuda"
    )
    result.stdout.fnmatch_lines(
        ["exportcheck float32: CUDA not available: float32 settings untouched"]
    )


# ----------------------------------------------------------------------------- TF32


def _legacy() -> tuple[bool, bool, str]:
    return (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )


@pytest.fixture
def tf32_on() -> object:
    """TF32 allowed everywhere (as many training scripts set it); restored afterwards."""
    before = _legacy()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[:2]
    torch.set_float32_matmul_precision(before[2])


@pytest.mark.usefixtures("tf32_on")
def test_tf32_is_off_while_a_cuda_run_lasts_and_restored_after() -> None:
    precision = Float32Precision(("cpu", "cuda"), cuda_available=lambda: True)
    precision.start()
    assert _legacy() == (False, False, "highest")
    assert precision.describe().startswith("TF32 off for this run")
    precision.stop()
    assert _legacy() == (True, True, "high")
    precision.stop()  # idempotent
    assert _legacy() == (True, True, "high")


@pytest.mark.usefixtures("tf32_on")
@pytest.mark.parametrize(
    ("devices", "available", "says"),
    [
        (("cpu",), True, "no CUDA device selected"),
        (("cuda",), False, "CUDA not available"),
    ],
)
def test_tf32_is_untouched_without_a_usable_cuda_device(
    devices: tuple[str, ...], available: bool, says: str
) -> None:
    precision = Float32Precision(devices, cuda_available=lambda: available)
    precision.start()
    assert _legacy() == (True, True, "high")
    assert says in precision.describe()
    precision.stop()
    assert _legacy() == (True, True, "high")


def test_tf32_settings_made_with_torchs_new_api_are_restored_as_they_were() -> None:
    # In a subprocess: after the new API is used, torch refuses legacy reads for
    # the rest of the process, which would disturb the other tests.
    code = textwrap.dedent(
        """
        import torch
        from pytest_exportcheck.session.environment._float32 import Float32Precision
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        precision = Float32Precision(("cuda",), cuda_available=lambda: True)
        precision.start()
        assert torch.backends.cuda.matmul.fp32_precision == "ieee", torch.backends.cuda.matmul.fp32_precision
        precision.stop()
        assert torch.backends.cuda.matmul.fp32_precision == "tf32", torch.backends.cuda.matmul.fp32_precision
        print("restored")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "restored"
