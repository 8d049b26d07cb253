"""A fake third-party exportlm plugin, installed through a real ``*.dist-info`` directory.

:func:`install` writes ``fakeplugin-1.0.dist-info`` (METADATA + entry_points.txt) and
the plugin modules into a directory; put that directory on ``PYTHONPATH`` of a pytest
subprocess and ``importlib.metadata`` discovers the plugin exactly as if it had been
``pip install``-ed. Some of its targets are wrong on purpose; each fault is named
after the check that must catch it. Every export appends the target name to the
file ``$FAKEPLUGIN_COUNTER``, so a test can count real exports (cache misses).
"""

from __future__ import annotations

from pathlib import Path

from tests._distinfo import make_distribution

__all__ = ["DIST", "install"]

DIST = "fakeplugin 1.0"

PLUGIN = '''
"""Toy export targets: torch.save of the wrapped model; a tiny runtime that torch.loads it."""
import os
from pathlib import Path

import torch

from exportlm.export import (
    ExportCacheWrapper, atomic_output, export_target, infer_vocab_size, make_input_ids,
)
from exportlm.models import build_model
from exportlm.module_exporters import QuantLinearExporter


def _count(name):
    with open(os.environ["FAKEPLUGIN_COUNTER"], "a") as f:
        f.write(name + "\\n")


def _inputs(model, example_inputs):
    if example_inputs is not None:
        return example_inputs
    return make_input_ids(infer_vocab_size(model), batch=1, seq=4, seed=0)


def _trace(model, example_inputs):
    wrapped = ExportCacheWrapper(model).eval()
    with torch.no_grad():
        wrapped(_inputs(model, example_inputs))  # like a trace: a model that raises fails here
    return wrapped


def _save(model, path, example_inputs):
    torch.save(_trace(model, example_inputs), path)


COMMON = dict(atol=1e-5, rtol=1e-5, capabilities={"dynamic_shapes", "cuda"}, suffix=".pt")


@export_target(
    "good", runtime="good", **COMMON,
    expected_failures={
        "demo_fail": "declared by the plugin: demo_fail always fails",
        "demo_xpass": "declared but the check passes: strict xfail must fail",
        "no_such_check": "matches nothing: must warn",
    },
)
def export_good(model, output_path, *, example_inputs=None):
    _count("good")
    with atomic_output(output_path) as tmp:
        _save(model, tmp, example_inputs)
    return Path(output_path)


def load_good(artifact, *, device="cpu"):
    module = torch.load(artifact, weights_only=False, map_location=device).eval()

    def run(input_ids):
        with torch.no_grad():
            return module(input_ids.to(device))

    return run


@export_target("perturb", runtime="perturb", **COMMON)
def export_perturb(model, output_path, *, example_inputs=None):
    _count("perturb")
    with atomic_output(output_path) as tmp:
        _save(model, tmp, example_inputs)
    return Path(output_path)


def load_perturb(artifact, *, device="cpu"):
    run = load_good(artifact, device=device)
    return lambda input_ids: run(input_ids) + 0.05  # FAULT (roundtrip_logits)


@export_target("inplace", runtime="good", **COMMON)
def export_inplace(model, output_path, *, example_inputs=None):
    _count("inplace")
    with open(output_path, "wb") as f:  # FAULT (atomic_failure): truncated before the trace
        torch.save(_trace(model, example_inputs), f)
    return Path(output_path)


@export_target("swallow", runtime="good", **COMMON)
def export_swallow(model, output_path, example_inputs=None, **ignored):  # FAULT (unknown_kwargs)
    _count("swallow")
    with atomic_output(output_path) as tmp:
        _save(model, tmp, example_inputs)
    return Path(output_path)


class OutsideExporter(QuantLinearExporter):
    """Also writes a copy outside its module's prefix (FAULT: export_contract), and says so."""

    name = "outside"
    keys = ("QuantLinear",)
    prepend = True
    expected_failures = {"export_contract": "declared by the exporter: writes a stray copy"}

    def export(self, name, module, ctx):
        super().export(name, module, ctx)
        ctx.emit(f"stray.{name}.copy", module.weight)


class ZeroScaleExporter(QuantLinearExporter):
    """Emits a zero weight_scale for MoE expert linears (FAULT: export_contract)."""

    name = "zeroscale"
    keys = ("QuantMoELinear",)
    prepend = True

    def export(self, name, module, ctx):
        ctx.emit_plain(f"{name}.weight", module.weight)
        ctx.emit_scale(f"{name}.weight_scale", torch.zeros(()))


def build_tiny(seed=0, **overrides):
    """A third-party toy model family (delegates to the built-in plain decoder)."""
    return build_model("decoder", seed, **overrides)
'''

BROKEN = """
raise ImportError("fakeplugin_broken needs libfoo, which is not installed")
"""

ENTRY_POINTS = {
    "exportlm.export_backends": {
        "good": "fakeplugin:export_good",
        "perturb": "fakeplugin:export_perturb",
        "inplace": "fakeplugin:export_inplace",
        "swallow": "fakeplugin:export_swallow",
        "broken": "fakeplugin_broken:export",
        "onnx": "fakeplugin:export_good",
    },
    "exportlm.export_runtimes": {
        "good": "fakeplugin:load_good",
        "perturb": "fakeplugin:load_perturb",
    },
    "exportlm.models": {"tiny": "fakeplugin:build_tiny"},
    "exportlm.module_exporters": {
        "outside": "fakeplugin:OutsideExporter",
        "zeroscale": "fakeplugin:ZeroScaleExporter",
        "brokenexp": "fakeplugin_broken:Exporter",
    },
}


def install(site: Path) -> Path:
    """Write the distribution into ``site`` (a directory to put on ``PYTHONPATH``)."""
    make_distribution(
        site,
        "fakeplugin",
        ENTRY_POINTS,
        {"fakeplugin.py": PLUGIN, "fakeplugin_broken.py": BROKEN},
    )
    return site
