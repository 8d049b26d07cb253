"""Checks on model structures drawn by Hypothesis instead of the fixed toy families.

The toy families all have vocabulary 256, hidden 128 and two layers, so a target
that pads the vocabulary wrongly or hard-codes a layer count passes every
per-model check. These checks draw decoder structures with
:func:`pytest_exportcheck.strategies.model_specs` (1-4 layers, GQA / MQA heads,
tied or untied ``lm_head``, dense Llama or Mixtral / Qwen3-MoE experts,
vocabularies 97-400 that are never multiples of 64), build them with
:func:`exportlm.models.build_from_spec` (seeded, nothing downloaded) and:

- ``roundtrip_generated`` (per target): export, load in the target's runtime,
  compare logits within the target's tolerance at the traced shape and at a
  drawn other shape;
- ``quantized_generated`` (per module exporter): quantize with every recipe that
  fits, export the quantized state through a recording registry, and check
  claims, FP8 weights, ties and dropped weights.

One module per check (:mod:`.roundtrip`, :mod:`.quantized`), and what they
share (:mod:`._shared`: the failure, the budget, the reproduction command).

A failure shrinks (Hypothesis) to the smallest structure, which the message
prints as JSON together with a command reproducing it outside pytest. The
properties run with ``database=None``; under the ``exportcheck-ci`` profile
(``CI`` set) they are derandomized, so every CI run checks the same structures.
"""

from __future__ import annotations

from pytest_exportcheck.checks.generated._shared import (
    GENERATED_EXAMPLES,
    GeneratedFailure,
    generated_budget,
    repro_command,
)
from pytest_exportcheck.checks.generated.quantized import generated_recipes, quantized_generated
from pytest_exportcheck.checks.generated.roundtrip import roundtrip_generated

__all__ = [
    "GENERATED_EXAMPLES",
    "generated_recipes",
    "GeneratedFailure",
    "generated_budget",
    "quantized_generated",
    "repro_command",
    "roundtrip_generated",
]
