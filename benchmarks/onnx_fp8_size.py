"""Size of an FP8 (and INT8 weight-only) QDQ ONNX file against the float one.

A toy Llama whose linears dominate (``--hidden 1024 --intermediate 4096``: 98% of the
parameters in the decoder layers' linears) is exported to ONNX as float32, then
quantized with ``fp8`` and with ``int8_wo`` and exported again. Printed for each:
the file size (graph plus external data), the bytes of the quantized initializers
(``get_onnx_info(...).quantized_bytes``) and the ratios to the float file. Sizes
are bytes, so the numbers are the same on every machine for the same versions of
torch and onnxscript; nothing is timed.

    python benchmarks/onnx_fp8_size.py [--hidden 1024] [--intermediate 4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from exportlm.export import export_to_onnx, get_onnx_info
from exportlm.models import build_model
from exportlm.quant import quantize


def _file_bytes(path: Path) -> int:
    """The graph plus any external data file next to it."""
    info = get_onnx_info(path)
    return path.stat().st_size + sum(
        (path.parent / f).stat().st_size for f in info.external_data_files
    )


def _linear_fraction(model: nn.Module) -> float:
    total = sum(p.numel() for p in model.parameters())
    linears = sum(
        m.weight.numel()
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and ".layers." in f".{n}."
    )
    return linears / total


def measure(hidden: int, intermediate: int, directory: Path) -> dict[str, Any]:
    """Export float, fp8 and int8_wo versions of one toy Llama; return sizes and ratios."""

    def build() -> nn.Module:
        return build_model("llama", seed=0, hidden_size=hidden, intermediate_size=intermediate)

    float_model = build()
    float_file = export_to_onnx(float_model, directory / "float.onnx")
    result: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "linear_fraction": round(_linear_fraction(float_model), 4),
        "float_bytes": _file_bytes(float_file),
    }
    for recipe in ("fp8", "int8_wo"):
        path = export_to_onnx(quantize(build(), recipe), directory / f"{recipe}.onnx")
        size = _file_bytes(path)
        result[recipe] = {
            "file_bytes": size,
            "quantized_bytes": get_onnx_info(path).quantized_bytes,
            "file_ratio": round(size / result["float_bytes"], 4),
        }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--json", type=Path, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args.hidden, args.intermediate, Path(tmp))
    print(
        f"llama hidden={result['hidden_size']} intermediate={result['intermediate_size']}: "
        f"{100 * result['linear_fraction']:.1f}% of parameters in decoder linears; "
        f"float file {result['float_bytes']:,} bytes"
    )
    for recipe in ("fp8", "int8_wo"):
        entry = result[recipe]
        print(
            f"  {recipe:8s} file {entry['file_bytes']:,} bytes "
            f"(quantized initializers {entry['quantized_bytes']:,}): "
            f"ratio to float {entry['file_ratio']:.3f}"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
