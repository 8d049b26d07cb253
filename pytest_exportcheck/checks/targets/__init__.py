"""Checks of export targets (scope ``"target"``), run for every target and variant.

Each check is a plain function ``(TargetCase) -> CheckResult``. Per-model checks
use the artifact shared through ``case.export`` (cached by the plugin); checks
that need an artifact of their own export into ``case.workdir``. One module per
concern:

- :mod:`.registration`: ``plugin_loads``, ``registered`` (the declaration);
- :mod:`.artifact`: ``artifact_contract`` (what an export writes);
- :mod:`.roundtrip`: ``roundtrip_logits``, ``dynamic_shapes``, ``cache_wrapper``,
  ``deterministic`` (what the artifact computes);
- :mod:`.failures`: ``atomic_failure``, ``unknown_kwargs`` (how a target fails);
- :mod:`.generation`: ``generation_parity``; :mod:`.trust`: ``trust``;
  :mod:`.quantized`: ``roundtrip_quantized``;
- :mod:`.checkpoint`: ``checkpoint_names`` and :mod:`.loadable`: ``loadable`` (what a
  quantized checkpoint directory says about itself).

``roundtrip_generated`` (:mod:`pytest_exportcheck.checks.generated`) is a target
check too.
"""

from __future__ import annotations

from pytest_exportcheck.checks.targets.artifact import artifact_contract
from pytest_exportcheck.checks.targets.failures import (
    MISSPELLED_KWARG,
    SENTINEL_BYTES,
    InjectedExportFailure,
    PoisonedParameter,
    atomic_failure,
    poison_last_parameter,
    unknown_kwargs,
)
from pytest_exportcheck.checks.targets.registration import plugin_loads, registered
from pytest_exportcheck.checks.targets.roundtrip import (
    DYNAMIC_SHAPES,
    cache_wrapper,
    deterministic,
    dynamic_shapes,
    roundtrip_logits,
)

__all__ = [
    "DYNAMIC_SHAPES",
    "MISSPELLED_KWARG",
    "SENTINEL_BYTES",
    "InjectedExportFailure",
    "PoisonedParameter",
    "artifact_contract",
    "atomic_failure",
    "cache_wrapper",
    "deterministic",
    "dynamic_shapes",
    "plugin_loads",
    "poison_last_parameter",
    "registered",
    "roundtrip_logits",
    "unknown_kwargs",
]
