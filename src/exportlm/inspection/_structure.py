"""Rules on files, names and configs: shards and index, tied and leaked tensors,
``quant_method``, listed module names and KV-cache scales."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from exportlm.errors import ExportLMError, MalformedCheckpointError
from exportlm.hfdir import custom_code_reasons, tokenizer_files
from exportlm.inspection._completeness import layer_count_of, layer_gap
from exportlm.inspection._config import config_field_problems, quant_config_problems
from exportlm.inspection._declared import MIXED_PRECISION, Declared
from exportlm.inspection._files import CONFIG, INDEX, Checkpoint
from exportlm.inspection._finegrained import transformers_tile_misread
from exportlm.inspection._loaders import (
    LayerRefusal,
    Misread,
    engine_misreads,
    engine_refusals,
    loaders_knowing,
    transformers_kv_scales_dropped,
    transformers_modelopt_misread,
)
from exportlm.inspection._names import listed_in, name_problems
from exportlm.inspection._rules import RULES, Finding
from exportlm.tokenizer_checks import chat_template_problems, json_problems

__all__ = ["config_findings", "config_file_findings", "file_findings", "kv_findings"]

#: Names of input embeddings a tied ``lm_head.weight`` duplicates.
_EMBEDDINGS = (
    "embed_tokens.weight",
    "wte.weight",
    "word_embeddings.weight",
    "tok_embeddings.weight",
)
_LM_HEAD = "lm_head.weight"
#: Name components that only quantizer internals use (ModelOpt's in-memory buffers).
_INTERNAL_SUFFIXES = ("_quantizer",)


def file_findings(checkpoint: Checkpoint) -> Iterator[Finding]:
    """``shard-*``, ``index-*``, ``layer-missing``, ``tied-duplicate``, ``leaked-buffer``."""
    for shard, problems in sorted(checkpoint.shard_problems.items()):
        for problem in problems:
            yield RULES[problem.rule].finding(
                shard, problem.message, file=shard, tensor=problem.field
            )
    yield from _index(checkpoint)
    yield from _layers(checkpoint)
    yield from _tied(checkpoint)
    for name in sorted(checkpoint.tensors):
        parts = name.split(".")
        internal = [p for p in parts if p.startswith("_") or p.endswith(_INTERNAL_SUFFIXES)]
        if internal:
            yield RULES["leaked-buffer"].finding(
                name,
                f"{name} is a quantizer-internal buffer ({internal[0]!r}), not a checkpoint "
                'tensor: no loader has a parameter of that name (vLLM: KeyError / "no module or '
                'parameter named"). Export the scales under their hub names (weight_scale, '
                "input_scale, ...) and drop the internal buffers",
            )


def _index(checkpoint: Checkpoint) -> Iterator[Finding]:
    rule = RULES["index-mismatch"]
    for name, files in sorted(checkpoint.locations.items()):
        if len(files) > 1:
            yield rule.finding(name, f"{name} is saved in {len(files)} shards ({', '.join(files)})")
    if checkpoint.index_problem:
        yield RULES["index-unreadable"].finding(
            INDEX,
            f"{checkpoint.index_problem}. Loaders find the shards through the index; rewrite it "
            "from the shards' headers",
        )
    for name, why in sorted(checkpoint.index_escapes.items()):
        yield RULES["index-path-escapes"].finding(
            f"{INDEX}: {name}",
            f"{INDEX} maps {name} to {why}: a loader would read a file outside the checkpoint "
            "(any file the user can read). Shard names are plain file names in the directory",
            tensor=name,
        )
    index = checkpoint.index
    if index is None:
        if len(checkpoint.shards) > 1:
            yield rule.finding(
                INDEX,
                f"{len(checkpoint.shards)} shards but no {INDEX}: loaders find sharded "
                "checkpoints through the index",
            )
        return
    for name, shard in sorted(index.items()):
        if name in checkpoint.index_escapes:
            continue
        held = checkpoint.locations.get(name)
        if held is None:
            missing = "" if shard in checkpoint.shards else f" (and {shard} does not exist)"
            yield rule.finding(
                name,
                f"{INDEX} maps {name} to {shard}, but no shard saves it{missing}; transformers "
                "and vLLM fail looking it up. Rewrite the index from the shards' headers",
                shard=shard,
            )
        elif shard not in held:
            yield rule.finding(name, f"{INDEX} maps {name} to {shard}, but {held[0]} saves it")
    for name in sorted(set(checkpoint.locations) - set(index)):
        yield rule.finding(
            name,
            f"{checkpoint.locations[name][0]} saves {name}, but {INDEX} does not list it: "
            "loaders that read the index never load it",
        )


def _layers(checkpoint: Checkpoint) -> Iterator[Finding]:
    """``layer-missing``: the loader's rule (:func:`layer_gap`); stored extras (MTP) pass here."""
    gap = layer_gap(layer_count_of(checkpoint.config), checkpoint.tensors)
    if gap is not None and gap.missing:
        yield RULES["layer-missing"].finding(
            f"{gap.prefix}.{gap.missing}", gap.message(), missing=gap.missing, file=CONFIG
        )


def _tied(checkpoint: Checkpoint) -> Iterator[Finding]:
    config = checkpoint.config
    tied = config.get("tie_word_embeddings")
    text = config.get("text_config")
    if tied is None and isinstance(text, dict):
        tied = text.get("tie_word_embeddings")
    if tied is not True:
        return
    heads = [n for n in checkpoint.tensors if n == _LM_HEAD or n.endswith("." + _LM_HEAD)]
    embeddings = [n for n in checkpoint.tensors if n.endswith(_EMBEDDINGS)]
    for head in heads:
        if embeddings:
            yield RULES["tied-duplicate"].finding(
                head,
                f"config.json sets tie_word_embeddings, yet both {embeddings[0]} and {head} are "
                "saved: the tied weight is written twice. Loaders keep one copy (vLLM skips "
                f"{_LM_HEAD} when tied) and silently drop the other, so if they differ the "
                "served model is not the exported one. Save the embedding only",
            )


def _refusals(checkpoint: Checkpoint, declared: Declared) -> list[Finding]:
    """``engine-refuses-scheme``: engines whose support table refuses the declared scheme."""
    labels = [MIXED_PRECISION] if declared.layers else [s.label for s in declared.schemes]
    found = []
    for refusal in engine_refusals(checkpoint.declaration.producer, declared.quant_method, labels):
        row = refusal.row
        found.append(
            RULES["engine-refuses-scheme"].finding(
                "config.json",
                f"{refusal.engine} refuses quant_method {row.quant_method!r} with algorithm "
                f"{refusal.label!r} while it validates the config ({row.message}; "
                f"{row.source}). {row.instead}",
                engine=refusal.engine,
                engine_name=row.engine,
                scheme=refusal.label,
                accepted=sorted(row.accepts),
                instead=row.instead,
            )
        )
    return found


def _misreads(checkpoint: Checkpoint, declared: Declared) -> list[Misread]:
    """The loaders that misread this checkpoint: by its formats, ``model_type`` and dtype."""
    schemes = [declared.default] if declared.default else list(declared.layers.values())
    formats = [s.spec.name for s in schemes if s is not None and s.spec is not None]
    config = checkpoint.config
    model_type = config.get("model_type")
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    kind = str(model_type) if model_type is not None else None
    found = engine_misreads(declared.quant_method, formats, kind, dtype)
    packings = [s.spec.packing for s in schemes if s is not None and s.spec is not None]
    hf = transformers_modelopt_misread(declared.quant_method, packings)
    tiles = transformers_tile_misread(checkpoint, declared)
    return [*found, *(m for m in (hf, tiles) if m is not None)]


def _method_findings(
    checkpoint: Checkpoint, declared: Declared, method: str, shapes: Sequence[LayerRefusal]
) -> Iterator[Finding]:
    """``quant-method-unknown``, ``engine-refuses-scheme`` and ``quant-method-loaders``
    (an engine in ``shapes`` fails on some layers' shapes: not listed as loading it)."""
    known, unknown = loaders_knowing(method)
    if not known:
        yield RULES["quant-method-unknown"].finding(
            "config.json",
            f"quantization_config.quant_method is {method!r}, which no loader checked here "
            f'knows ({", ".join(unknown)}): loading fails with "Unknown quantization '
            "method\". Use 'modelopt' or 'compressed-tensors'",
        )
        return
    refused = _refusals(checkpoint, declared)
    yield from refused
    refusing = sorted({str(f.details["engine"]) for f in refused})
    misread = _misreads(checkpoint, declared)
    names = {f.details["engine_name"] for f in refused} | {m.engine for m in misread}
    failing = [r for r in shapes if r.engine not in names and r.engine in known]
    names |= {r.engine for r in failing}
    loads = [loader for loader in known if loader.split(" ")[0] not in names]
    unknown = [loader for loader in unknown if loader.split(" ")[0] not in names]
    for m in misread:
        yield RULES["loader-misreads"].finding(
            "config.json",
            f"misread by {m.engine} {m.version}: it loads this checkpoint without an error "
            f"and computes something else ({m.evidence})",
            engine=f"{m.engine} {m.version}",
        )
    dropped = transformers_kv_scales_dropped(method, declared.kv_cache)
    if unknown or refusing or misread or dropped or failing:
        said = [f"loads in {', '.join(loads)}" if loads else "loads in no engine checked here"]
        said += [dropped] if dropped and any(n.startswith("transformers") for n in loads) else []
        said += [f"refused by {', '.join(refusing)} (its algorithm)"] if refusing else []
        said += [
            f"fails in {r.engine} on {r.reason}, which it does not read ({r.rule})" for r in failing
        ]
        said += [f"misread by {m.engine} {m.version} ({m.evidence})" for m in misread]
        said += [f"not in {', '.join(unknown)}"] if unknown else []
        yield RULES["quant-method-loaders"].finding(
            "config.json",
            f"quant_method {method!r} {'; '.join(said)}",
            known=loads,
            refused=refusing,
            fails=list(dict.fromkeys(r.engine for r in failing)),
            misread=[f"{m.engine} {m.version}" for m in misread],
            unknown=unknown,
            kv_scales_dropped=dropped is not None,
        )


def config_findings(
    checkpoint: Checkpoint,
    declared: Declared,
    quantized: int,
    shapes: Sequence[LayerRefusal] = (),
) -> Iterator[Finding]:
    """``quant-method-*``, ``quant-config-missing`` and the listed-name rules; ``shapes``:
    the engines the layer rules find failing on some layers' shapes."""
    method = declared.quant_method
    if method is not None:
        yield from _method_findings(checkpoint, declared, method, shapes)
    elif quantized and declared.layout == "none":
        yield RULES["quant-config-missing"].finding(
            "config.json",
            f"{quantized} layer(s) store quantized weights, but neither config.json "
            "(quantization_config) nor hf_quant_config.json declares a quantization: loaders "
            "read the codes as full-precision weights. Write the quantization config",
        )
    elif quantized:  # ModelOpt's hf_quant_config.json only
        yield RULES["quant-config-missing"].finding(
            "config.json",
            "only hf_quant_config.json declares the quantization; config.json has no "
            "quantization_config, so transformers (and SGLang without --quantization modelopt) "
            "loads the codes as full-precision weights. Add quantization_config "
            "(quant_method 'modelopt') to config.json",
        )
    listed = listed_in(checkpoint.declaration, bool(checkpoint.config.get("tie_word_embeddings")))
    for problem in name_problems(checkpoint.tensors, listed):
        if problem.kind == "excludes-quantized":
            rule = RULES["excluded-but-quantized"]
        else:
            rule = RULES["excluded-name-unknown" if problem.item.excluded else "layer-name-unknown"]
        yield rule.finding(problem.subject, problem.message, listed_in=problem.item.where)


def kv_findings(checkpoint: Checkpoint, declared: Declared) -> Iterator[Finding]:
    """``kv-scale-missing`` and ``kv-scale-undeclared``."""
    names = checkpoint.tensors
    stored = sorted(n for n in names if n.endswith((".k_scale", ".v_scale")))
    if not declared.kv_cache:
        if stored:
            yield RULES["kv-scale-undeclared"].finding(
                stored[0],
                f"{len(stored)} KV-cache scale(s) are saved (e.g. {stored[0]}) but "
                f"{declared.source} declares no KV-cache quantization (kv_cache_quant_algo / "
                "kv_cache_scheme): loaders ignore them, or warn and use 1.0",
            )
        return
    attention = sorted(
        n.removesuffix(".k_proj.weight") for n in names if n.endswith(".k_proj.weight")
    )
    for attn in attention:
        for kind in ("k", "v"):
            candidates = (f"{attn}.{kind}_proj.{kind}_scale", f"{attn}.{kind}_scale")
            if not any(c in names for c in candidates):
                yield RULES["kv-scale-missing"].finding(
                    candidates[0],
                    f"{declared.source} declares KV-cache quantization, but attention {attn} "
                    f"saves no {kind}_scale ({' or '.join(candidates)}): vLLM falls back to a "
                    "scale of 1.0 (wrong cache values) or fails. Export the KV-cache scales",
                )
    if not attention and not stored:
        yield RULES["kv-scale-missing"].finding(
            declared.source,
            f"{declared.source} declares KV-cache quantization but no k_scale / v_scale is saved",
        )


def config_file_findings(checkpoint: Checkpoint) -> Iterator[Finding]:
    """``config-unreadable``, ``config-field-invalid``, ``custom-code``, ``quant-algo-unknown``."""
    for file, why in sorted(checkpoint.config_problems.items()):
        yield RULES["config-unreadable"].finding(file, why)
    if CONFIG not in checkpoint.config_problems:
        for field, message in config_field_problems(checkpoint.config):
            yield RULES["config-field-invalid"].finding(f"{CONFIG}: {field}", message, field=field)
    unreadable = None
    try:
        reasons = custom_code_reasons(checkpoint.directory, checkpoint.config)
    except MalformedCheckpointError as err:  # a tokenizer / processor config that is not JSON
        yield RULES["config-unreadable"].finding(str(err.path), str(err))
        reasons, unreadable = [], os.path.basename(str(err.path))
    for reason in reasons:
        yield RULES["custom-code"].finding(
            reason.split(" ")[0],
            f"{reason}: transformers would import and run the checkpoint's own code "
            "(trust_remote_code), and exportlm's loader refuses it. Use an architecture "
            "transformers ships, or load the model with code you have reviewed",
        )
    for rule, subject, message in quant_config_problems(checkpoint.declaration):
        yield RULES[rule].finding(subject, message)
    yield from _tokenizer(checkpoint, unreadable)


#: The files a tokenizer's vocabulary is read from; one of them makes the checkpoint servable.
_VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _tokenizer(checkpoint: Checkpoint, reported: str | None) -> Iterator[Finding]:
    """``config-unreadable`` for a tokenizer's JSON file (but ``reported``, already said),
    ``chat-template-invalid``, ``tokenizer-missing`` (no vocabulary file beside the weights)."""
    try:
        files = tokenizer_files(checkpoint.directory)
    except ExportLMError:  # custom code, a link out, a FIFO: their own rules and refusals
        files = {}
    for name, problem in json_problems(files):
        if name != reported:
            yield RULES["config-unreadable"].finding(
                name,
                f"the tokenizer file {name} {problem}: transformers, vLLM and SGLang fail "
                "to load the checkpoint's tokenizer. Copy the source model's file again",
            )
    for where, problem in chat_template_problems(files):
        yield RULES["chat-template-invalid"].finding(
            where.split(":")[0],
            f"the chat template {where} {problem}: the checkpoint loads, and every chat "
            "request (transformers' apply_chat_template, vLLM's and SGLang's chat endpoints) "
            "fails. Fix the template in the source model and export again",
        )
    if any(os.path.lexists(checkpoint.directory / name) for name in _VOCABULARY_FILES):
        return
    yield RULES["tokenizer-missing"].finding(
        checkpoint.directory.name or str(checkpoint.directory),
        f"no tokenizer file ({', '.join(_VOCABULARY_FILES)}): vLLM and transformers "
        "cannot serve the checkpoint as it is. Export it with its tokenizer (`exportlm "
        "export --model DIR` copies the directory's; export_model(..., tokenizer=...)) or "
        "copy the source model's tokenizer files and chat template into it",
    )
