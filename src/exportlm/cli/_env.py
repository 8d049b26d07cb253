"""``exportlm env``: what a bug report needs, as text or JSON.

Versions of exportlm and of the libraries it drives, Python and the platform,
torch's CPU capability and thread counts, CUDA devices, the environment
variables that change exportlm's behaviour, and what is registered (including
plugins that failed to load). Nothing here can fail the command: whatever
cannot be determined is reported as such.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from typing import Any

from exportlm._libraries import ENVIRONMENT_LIBRARIES
from exportlm.cli._list import print_table

__all__ = ["PACKAGES", "cmd_env", "collect_env"]

#: Distributions whose versions a bug report needs, in the order shown.
PACKAGES = ENVIRONMENT_LIBRARIES
_ENV_NAMES = ("ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "CI")
_NOT_INSTALLED = "not installed"


def cmd_env(as_json: bool) -> int:
    """Print the environment report."""
    report = collect_env()
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"exportlm {report['packages']['exportlm']}")
    python = report["python"]
    print(f"Python {python['version']} ({python['implementation']}, {python['executable']})")
    print(f"Platform {report['platform']}")
    print("\nPackages:")
    print_table(None, list(report["packages"].items()))
    print("\nTorch:")
    print_table(None, _torch_rows(report["torch"]))
    print("\nEnvironment:")
    variables = report["environment"]
    if variables:
        for name, value in variables.items():
            print(f"  {name}={value}")
    else:
        print(f"  (none of EXPORTLM_*, {', '.join(_ENV_NAMES)} is set)")
    print("\nRegistered:")
    registered = report["registered"]
    if "error" in registered:
        print(f"  cannot load the registries: {registered['error']}")
        return 0
    rows = [
        (kind.replace("_", " "), ", ".join(names) or "(none)") for kind, names in registered.items()
    ]
    print_table(None, [r for r in rows if r[0] != "failed plugins"])
    failures = registered["failed_plugins"]
    print("\nPlugins that failed to load:" + ("" if failures else " none"))
    for failure in failures:
        print(f"  {failure}")
    return 0


def collect_env() -> dict[str, Any]:
    """The report as JSON data: ``packages``, ``python``, ``platform``, ``torch``, ``environment``, ``registered``."""
    return {
        "packages": {name: _version(name) for name in PACKAGES},
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "platform": platform.platform(),
        "torch": _torch_facts(),
        "environment": {
            name: value
            for name, value in sorted(os.environ.items())
            if name.startswith("EXPORTLM_") or name in _ENV_NAMES
        },
        "registered": _registered(),
    }


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return _NOT_INSTALLED


def _torch_facts() -> dict[str, Any]:
    try:
        import torch
    except ImportError as err:
        return {"error": f"cannot import torch: {err}"}
    from exportlm.quant._gemm import describe

    cuda = torch.cuda.is_available()
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "calibration_half_matmuls": describe(),
        "intra_op_threads": torch.get_num_threads(),
        "inter_op_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count(),
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda
        else [],
    }


def _torch_rows(facts: dict[str, Any]) -> list[tuple[str, str]]:
    if "error" in facts:
        return [("error", facts["error"])]
    if facts["cuda_available"]:
        cuda = f"{len(facts['cuda_devices'])} device(s): {', '.join(facts['cuda_devices'])}"
    elif facts["cuda_version"] is None:
        cuda = "not available (torch built without CUDA)"
    else:
        cuda = f"not available (torch built with CUDA {facts['cuda_version']}, no device found)"
    return [
        ("CPU capability", str(facts["cpu_capability"])),
        ("bf16 matmuls", str(facts["calibration_half_matmuls"])),
        ("threads", f"{facts['intra_op_threads']} intra-op, {facts['inter_op_threads']} inter-op"),
        ("CPUs", str(facts["cpu_count"])),
        ("CUDA", cuda),
    ]


def _registered() -> dict[str, Any]:
    from exportlm.cli._inventory import collect_inventory

    try:
        inventory = collect_inventory()
    except Exception as err:  # the report must come out even when the registries cannot load
        return {"error": f"{type(err).__name__}: {err}"}
    return {
        "targets": [t["name"] for t in inventory.targets],
        "runtimes": [r["name"] for r in inventory.runtimes],
        "module_exporters": [e["name"] for e in inventory.module_exporters],
        "models": [m["name"] for m in inventory.models],
        "engines": [e["name"] for e in inventory.engines],
        "quant_formats": [f["name"] for f in inventory.quant_formats],
        "recipes": [r["name"] for r in inventory.recipes],
        "failed_plugins": [f"{f['registry']}: {f['error']}" for f in inventory.failed_plugins],
    }
