"""Checks of module exporters (scope ``"exporter"``), run for every exporter by name.

``case.name`` is a name in ``exportlm.module_exporters.EXPORT_MODULE_REGISTRY``; the
exporter's dispatch entry (keys, predicate, position) is read from
``EXPORT_MODULE_REGISTRY``. Registry experiments run on copies; the global
registry is never modified.

Examples of what an exporter claims come from the toy models quantized with
every recipe (:mod:`pytest_exportcheck.checks._survey`) and from the exporter's
optional ``conformance_examples()`` method: a third-party exporter for module
types the toy models do not contain returns a few instances of them there, e.g.::

    class MyExporter(ModuleExporter):
        keys = ("MyQuantConv",)

        def conformance_examples(self) -> list[nn.Module]:
            return [quantize(MyConvModel(), "fp8").conv]

Checks that need examples skip, with that reason, when there are none. One
module per concern:

- :mod:`.dispatch`: ``mro_match``, ``name_match``, ``predicate_match`` (what an
  entry claims);
- :mod:`.order`: ``precedence``, ``reachable`` (where the entry sits);
- :mod:`.contract`: ``claims_all_quantized``, ``export_contract`` (what an export
  call may do);
- :mod:`.layout`: ``moe_inputs``, ``tied_weights`` (what the checkpoint holds).
- :mod:`.fp8_gemm`: ``fp8_gemm`` (the FP8 linears through ``torch._scaled_mm``, on CUDA);
- :mod:`.golden`: ``golden_checkpoint``, ``golden_calibration`` (what the exporter
  writes for fixed quantized toy models, against goldens); :mod:`.values`: the value
  checks of an exporter's own conformance model.

``quantized_generated`` (:mod:`pytest_exportcheck.checks.generated`) is an exporter
check too.
"""

from __future__ import annotations

from pytest_exportcheck.checks.exporters._examples import EXAMPLES_HOOK
from pytest_exportcheck.checks.exporters.contract import (
    claims_all_quantized,
    export_contract,
    tensor_problems,
)
from pytest_exportcheck.checks.exporters.dispatch import mro_match, name_match, predicate_match
from pytest_exportcheck.checks.exporters.layout import moe_inputs, tied_weights
from pytest_exportcheck.checks.exporters.order import precedence, reachable

__all__ = [
    "EXAMPLES_HOOK",
    "claims_all_quantized",
    "export_contract",
    "moe_inputs",
    "mro_match",
    "name_match",
    "precedence",
    "predicate_match",
    "reachable",
    "tensor_problems",
    "tied_weights",
]
