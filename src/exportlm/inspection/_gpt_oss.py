"""gpt-oss's MXFP4 layout (``quant_method: "mxfp4"``) against what its two loaders quantize.

Both decide per module from ``quant_method`` and ``modules_to_not_convert``, each its own way:

* transformers (5.19, ``integrations/mxfp4.py`` ``replace_with_mxfp4_linear``): every
  ``GptOssExperts`` that no entry covers becomes ``Mxfp4GptOssExperts``, whose
  ``gate_up_proj`` / ``down_proj`` parameters have the uint8 blocks' shape, and a covered one
  stays float ``GptOssExperts``; an entry covers a module as ``should_convert_module``
  (``quantizers/quantizers_utils.py``) matches: ``re.match(entry, module)`` or
  ``module.endswith(entry)`` (an entry is a regular expression: openai's
  ``model.layers.*.self_attn``). Without its MXFP4 kernels (CPU, no triton:
  ``quantizer_mxfp4.py`` ``_process_model_before_weight_loading``) it dequantizes instead:
  ``replace_with_mxfp4_linear`` returns at once and ``Mxfp4Dequantize`` turns every
  ``<p>_blocks`` / ``<p>_scales`` pair into the float ``<p>``, listed or not (measured with
  5.25 on CPU). Its weight conversions name only ``gate_up_proj_blocks`` / ``down_proj_blocks``.
* vLLM (0.32, ``quantization/mxfp4.py``): ``Mxfp4Config.from_config`` returns ``cls()`` and
  reads no ``modules_to_not_convert``; ``get_quant_method`` gives every ``LinearBase``
  ``UnquantizedLinearMethod`` and every ``RoutedExperts`` the MXFP4 MoE method; the model's
  ``hf_to_vllm_mapper`` (``models/gpt_oss.py``) maps an experts module's
  ``gate_up_proj_blocks`` / ``down_proj_blocks``, and its float ``gate_up_proj`` /
  ``down_proj`` too, onto the MXFP4 ``w13_weight`` / ``w2_weight``.

exportlm's loader reads floats and blocks wherever an experts module stores them and refuses
blocks outside one. A module is an experts module by the layout's ``quantized_modules``
(``*.mlp.experts``). Entries are matched as ``re.match`` matches them, groups and alternation
included, but without backtracking (:mod:`~exportlm.inspection._entry_regex`), so no entry a
config holds makes ``inspect`` hang; an entry it cannot match so (a backreference, a
lookaround, inline flags, over its state limit) is reported (``mxfp4-entry-not-evaluated``)
and read as covering the modules it is a suffix of only.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterator, Sequence

from exportlm.inspection._declared import Declared
from exportlm.inspection._entry_regex import EntryMatcher, compile_entry
from exportlm.inspection._files import CONFIG, FLOAT_SCALE_DTYPES, Checkpoint
from exportlm.inspection._layers import modules_of
from exportlm.inspection._rules import RULES, Finding
from exportlm.quant.formats import CHECKPOINT_LAYOUTS, formats

__all__ = ["gpt_oss_findings"]

_LAYOUT = "gpt-oss-mxfp4"
_FIELD = "modules_to_not_convert"


def _entries(value: object) -> tuple[list[str], str | None]:
    """The entries transformers matches, and why the field is invalid (``None``: it is not)."""
    if value is None:
        return [], None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return [], (
            f"{_FIELD} is {value!r}, expected a list of module names (transformers iterates it, "
            "a string letter by letter)"
        )
    for entry in value:
        try:
            re.compile(entry)
        except (re.error, RecursionError) as err:  # RecursionError: groups nested too deep
            return [], (
                f"{_FIELD} entry {entry!r} is no regular expression ({err}): transformers' "
                "should_convert_module matches every entry with re.match and raises on it"
            )
    return list(value), None


def _covering(module: str, entries: Sequence[EntryMatcher | str]) -> str | None:
    """The entry that leaves ``module`` unconverted in transformers, or ``None``
    (``should_convert_module``: its ``re.match(entry + "\\.")`` implies ``re.match(entry)``);
    an entry not compiled (a ``str``) is matched as a suffix only."""
    for entry in entries:
        text = entry if isinstance(entry, str) else entry.entry
        if module.endswith(text) or (isinstance(entry, EntryMatcher) and entry.match(module)):
            return text
    return None


def _compiled(entries: list[str]) -> tuple[list[EntryMatcher | str], list[Finding]]:
    """Each entry compiled (kept as its text where it cannot be), and a finding for each of those."""
    compiled: list[EntryMatcher | str] = []
    findings: list[Finding] = []
    for entry in entries:
        matcher = compile_entry(entry)
        if isinstance(matcher, EntryMatcher):
            compiled.append(matcher)
            continue
        compiled.append(entry)
        findings.append(
            RULES["mxfp4-entry-not-evaluated"].finding(
                f"{CONFIG}: {_FIELD}",
                f"{_FIELD} entry {entry!r} holds {matcher}, which inspect does not match as a "
                "regular expression (it matches without backtracking, so that no entry makes "
                "it hang): the mxfp4 rules read the entry as covering only the modules whose "
                "names end with it. transformers' should_convert_module matches it with "
                "re.match, so which experts modules it keeps float is not checked here. Write "
                "the entry with literals, '.', classes, groups, alternation and repeats, or "
                "list the modules by name",
                entry=entry,
                why=matcher,
            )
        )
    return compiled, findings


def gpt_oss_findings(checkpoint: Checkpoint, declared: Declared) -> Iterator[Finding]:
    """``mxfp4-*`` findings and ``config-field-invalid`` for ``modules_to_not_convert``."""
    if declared.layout != _LAYOUT:
        return
    section = checkpoint.declaration.config
    texts, invalid = _entries(section.not_converted if section is not None else None)
    if invalid is not None:
        yield RULES["config-field-invalid"].finding(
            f"{CONFIG}: {_FIELD}", f"{CONFIG} quantization_config: {invalid}", field=_FIELD
        )
    entries, not_evaluated = _compiled(texts)
    yield from not_evaluated
    layout = CHECKPOINT_LAYOUTS[_LAYOUT]
    stored = {
        leaf.name for spec in formats() if layout.holds(spec) for leaf in layout.weight_leaves(spec)
    }
    for module, leaves in sorted(modules_of(checkpoint).items()):
        is_experts = any(fnmatch.fnmatchcase(module, p) for p in layout.quantized_modules)
        quantized = sorted(n for n in leaves if n.endswith(tuple(f"_{leaf}" for leaf in stored)))
        if quantized and not is_experts:
            yield _outside(module, leaves[quantized[0]].name, layout.quantized_modules)
        elif quantized and (entry := _covering(module, entries)) is not None:
            yield _listed_blocks(module, leaves[quantized[0]].name, entry)
        floats = [i for i in leaves.values() if i.dtype in FLOAT_SCALE_DTYPES and len(i.shape) > 2]
        for info in sorted(floats, key=lambda i: i.name) if is_experts else ():
            yield _float_experts(module, info.name, _covering(module, entries))


def _outside(module: str, tensor: str, experts: tuple[str, ...]) -> Finding:
    return RULES["mxfp4-blocks-outside-experts"].finding(
        tensor,
        f"{module} stores MXFP4 blocks / scales ({tensor}), but in gpt-oss's layout only experts "
        f"modules ({', '.join(experts)}) are: vLLM's Mxfp4Config gives every linear "
        "UnquantizedLinearMethod and its gpt_oss loader maps no such name (q / k / v fail "
        "with a KeyError, any other with 'Following weights were not initialized from "
        "checkpoint'), transformers drops the "
        "tensors as unexpected and initializes the module's weight at random, and exportlm's "
        "loader refuses the checkpoint. Store the module in float and list it in "
        "modules_to_not_convert",
        module=module,
    )


def _listed_blocks(module: str, tensor: str, entry: str) -> Finding:
    return RULES["mxfp4-excluded-but-quantized"].finding(
        tensor,
        f"modules_to_not_convert entry {entry!r} covers {module}, which stores MXFP4 blocks "
        f"({tensor}). vLLM reads no modules_to_not_convert and loads the blocks, as do "
        "transformers' dequantizing load (CPU) and exportlm's loader; transformers' MXFP4 "
        "kernel load (GPU) keeps the covered module a float GptOssExperts and writes the "
        "swizzled blocks into it (Mxfp4Deserialize), which its float forward cannot run (read "
        "from its source; not run here). Drop the "
        "entry, or dequantize the module and store it in float",
        module=module,
        entry=entry,
    )


def _float_experts(module: str, tensor: str, entry: str | None) -> Finding:
    vllm = (
        "vLLM reads no modules_to_not_convert and quantizes every experts module: it maps "
        f"{tensor} onto the MXFP4 parameter (w13_weight / w2_weight, uint8 of the blocks' "
        "shape), which a float tensor does not fit"
    )
    if entry is not None:
        return RULES["mxfp4-float-experts-listed"].finding(
            tensor,
            f"{module} stores float weights ({tensor}) and modules_to_not_convert entry "
            f"{entry!r} covers it: transformers keeps it float, exportlm's loader reads it as "
            f"stored; {vllm}. "
            "For vLLM, quantize every experts module",
            module=module,
            entry=entry,
        )
    return RULES["mxfp4-float-experts"].finding(
        tensor,
        f"{module} stores float weights ({tensor}) and no modules_to_not_convert entry covers "
        f"it: {vllm}, and transformers' MXFP4 kernel load (GPU) makes it an "
        "Mxfp4GptOssExperts, whose parameters have the blocks' shape. Only dequantizing loads "
        "(transformers on CPU, exportlm's loader) read it. Store its projections as "
        "<p>_blocks / <p>_scales (export with -o format=gpt-oss-mxfp4)",
        module=module,
    )
