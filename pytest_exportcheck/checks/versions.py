"""Versions of the conformance catalogue: which built-in checks each version added.

A plugin pins the version it conforms to (``exportcheck_catalogue = 2`` in its
pytest ini, or ``--export-catalogue=2``) and gets exactly that version's items;
the items of checks and toy model families added later are counted and reported
("N items new in v3 not run") until it adopts them. Unpinned, a run plans every
item of :data:`CATALOGUE_VERSION`.

The history is read from git (the commit that first added each check id or
family): families carry their version on their record (``ModelFamily.since``
in ``exportlm.models``), checks here. Pure data; imports nothing.
"""

from __future__ import annotations

__all__ = ["CATALOGUE_HISTORY", "CATALOGUE_VERSION", "CHECKS_SINCE"]

#: The current catalogue version: what an unpinned run plans.
CATALOGUE_VERSION = 4

#: version -> (date, what it added), newest last (``docs/checks.md``, "Catalogue versions").
CATALOGUE_HISTORY: dict[int, tuple[str, str]] = {
    1: ("2026-11-29", "the first suite: registration, roundtrip and contract checks, "
        "module-exporter checks; families decoder, decoder_tied, iterable_moe, llama, "
        "llama_tied, mixtral, qwen2_moe, qwen3_moe, gpt_oss"),
    2: ("2026-11-30", "quantized checkpoints, Hypothesis-generated structures, goldens"),
    3: ("2026-11-30", "trust, generation and serving checks, FP8 GEMM; families llama4, dbrx"),
    4: ("2026-12-01", "served: the artifact run in the real engines that load it"),
}  # fmt: skip

#: version -> the built-in check ids it added.
_ADDED: dict[int, tuple[str, ...]] = {
    1: (
        "plugin_loads", "registered", "artifact_contract", "roundtrip_logits",
        "dynamic_shapes", "cache_wrapper", "deterministic", "atomic_failure",
        "unknown_kwargs", "mro_match", "name_match", "predicate_match", "precedence",
        "reachable", "claims_all_quantized", "export_contract", "moe_inputs", "tied_weights",
    ),
    2: (
        "checkpoint_names", "roundtrip_generated", "quantized_generated",
        "golden_checkpoint", "golden_calibration",
    ),
    3: ("trust", "generation_parity", "loadable", "roundtrip_quantized", "fp8_gemm"),
    4: ("served",),
}  # fmt: skip

#: check id -> the catalogue version that added it (a built-in check missing here
#: belongs to :data:`CATALOGUE_VERSION`).
CHECKS_SINCE: dict[str, int] = {c: v for v, ids in _ADDED.items() for c in ids}
