"""What an ONNX export writes and replaces beside its graph: tokenizer files, and the siblings it owns.

* ``tokenizer=``: the tokenizer's files (``tokenizer.json``, ``tokenizer_config.json``, the
  chat template, ...) are written beside the graph, in the export's staging folder, so
  they are published with it and listed in its manifest, as the ``hf_checkpoint`` target
  carries them (:mod:`exportlm.export.hf_checkpoint.tokenizer` reads them, by the same
  safe rules). Only files at the top of the tokenizer's folder are carried: a named extra
  chat template (``additional_chat_templates/*.jinja``) is left out, with a warning.
* :func:`owned_companions`: the sibling names a publish may replace or remove. Those are
  the graph's external data (named after the graph), the files this export writes, and
  the files the previous export of this graph listed in its manifest: a file of the
  folder that exportlm did not write (a model directory's own ``config.json``) is never
  removed by an export of a graph beside it.
* :func:`genai_pad_token_id`: the ``pad_token_id`` of ``genai_config.json``.
  onnxruntime-genai builds its attention mask from that id (a position whose token is
  the pad id is masked), so the id must be one that no prompt holds. A chat model's
  ``pad_token_id`` is often its end-of-turn token (SmolLM2: ``<|im_end|>``), which every
  chat prompt holds; given the tokenizer, a special token that neither the chat template
  nor the begin/end-of-sequence ids use is chosen instead.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from exportlm.errors import ExportLMError
from exportlm.export.hf_checkpoint.tokenizer import tokenizer_payload
from exportlm.export.manifest import read_manifest

__all__ = ["genai_pad_token_id", "owned_companions", "tokenizer_beside_graph"]

logger = logging.getLogger(__name__)


def tokenizer_beside_graph(tokenizer: Any) -> dict[str, bytes]:
    """``{file name: bytes}`` of ``tokenizer`` (``None``, a directory or an object with
    ``save_pretrained``) that an ONNX folder carries: its top-level files. Read before
    the export does any work (a refused tokenizer costs nothing)."""
    files = tokenizer_payload(tokenizer)
    nested = sorted(name for name in files if "/" in name)
    if nested:
        logger.warning(
            "onnx export: the tokenizer's %s are not carried beside the graph (an ONNX "
            "artifact's files sit in one folder); its tokenizer.json, tokenizer config and "
            "default chat template are",
            ", ".join(nested),
        )
    return {name: data for name, data in files.items() if "/" not in name}


def owned_companions(destination: Path, writes: Iterable[str]) -> tuple[str, ...]:
    """Glob patterns of the siblings of ``destination`` (the ``.onnx`` path) that its publish
    may replace or prune: its external data, ``writes`` (what this export puts beside it)
    and the files its previous manifest listed. A previous manifest that cannot be read
    owns nothing (its files stay)."""
    name = destination.name
    previous: set[str] = set()
    with contextlib.suppress(ExportLMError, OSError):
        manifest = read_manifest(destination)
        if manifest is not None:
            previous = {f for f in manifest.files if "/" not in f and f != name}
    owned = sorted({*writes, *previous})
    return (f"{name}.data", f"{name}.*.data", *(glob.escape(f) for f in owned))


def genai_pad_token_id(config: Any, tokenizer: Mapping[str, bytes]) -> int:
    """The id ``genai_config.json`` names as padding: one that no prompt holds.

    In order: the config's ``pad_token_id``, then the tokenizer's special tokens by id; the
    first that is neither a begin/end-of-sequence id nor a special token the chat template
    writes. Without a tokenizer, or when every
    candidate is held, the config's pad id (else its end-of-sequence id, else 0), with a
    warning where that id is also the end-of-sequence id.
    """
    eos = _ids(getattr(config, "eos_token_id", None))
    bos = _ids(getattr(config, "bos_token_id", None))
    pad = getattr(config, "pad_token_id", None)
    specials = _special_tokens(tokenizer)
    template = _chat_templates(tokenizer)
    held = {*eos, *bos, *(i for content, i in specials if content in template)}
    candidates = [*_ids(pad), *(i for _, i in sorted(specials, key=lambda s: s[1]))]
    for candidate in candidates:
        if candidate not in held:
            return candidate
    fallback = next(iter([*_ids(pad), *eos]), 0)
    if fallback in eos:
        logger.warning(
            "onnx export: genai_config.json's pad_token_id is %d, the end-of-sequence id; "
            "onnxruntime-genai masks every position holding it, so a prompt that holds it "
            "(a chat turn's end) is misread. Pass tokenizer= (the model's directory) so a "
            "special token no prompt holds is chosen",
            fallback,
        )
    return fallback


def _ids(value: Any) -> list[int]:
    values = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def _json(tokenizer: Mapping[str, bytes], name: str) -> Any:
    data = tokenizer.get(name)
    if data is None:
        return None
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None  # the export copies it as given; it names no special token here


def _special_tokens(tokenizer: Mapping[str, bytes]) -> list[tuple[str, int]]:
    """``(content, id)`` of the tokenizer's special added tokens (``tokenizer.json``)."""
    found = _json(tokenizer, "tokenizer.json")
    added = found.get("added_tokens") if isinstance(found, dict) else None
    return [
        (t["content"], t["id"])
        for t in (added if isinstance(added, list) else [])
        if isinstance(t, dict)
        and t.get("special") is True
        and isinstance(t.get("content"), str)
        and _ids(t.get("id"))
    ]


def _chat_templates(tokenizer: Mapping[str, bytes]) -> str:
    """Every chat template the tokenizer carries, as one text (to search for token strings)."""
    texts: list[str] = []
    jinja = tokenizer.get("chat_template.jinja")
    if jinja is not None:
        texts.append(jinja.decode("utf-8", errors="replace"))
    for name in ("tokenizer_config.json", "chat_template.json"):
        found = _json(tokenizer, name)
        template = found.get("chat_template") if isinstance(found, dict) else None
        if isinstance(template, str):
            texts.append(template)
        elif isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            texts += [t["template"] for t in template if isinstance(t, dict) and _is_text(t)]
    return "\n".join(texts)


def _is_text(entry: Mapping[str, Any]) -> bool:
    return isinstance(entry.get("template"), str)
