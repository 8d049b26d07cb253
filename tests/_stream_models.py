"""Small Llama checkpoints on disk for the streaming tests (seeded, sharded, bf16)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def llama_directory(
    root: Path, *, tied: bool, layers: int = 3, seed: int = 0, **config: Any
) -> Path:
    """A sharded bf16 Llama saved with ``save_pretrained`` under ``root / "src"``.

    Hidden 128 / intermediate 256, so INT4 AWQ (groups of 128) applies to every linear.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    values: dict[str, Any] = {
        "vocab_size": 256,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "tie_word_embeddings": tied,
        "dtype": "bfloat16",
    }
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**(values | config))).to(torch.bfloat16)
    directory = root / "src"
    model.save_pretrained(directory, max_shard_size="100KB")
    return directory


def family_directory(root: Path, family: str, *, seed: int = 0) -> Path:
    """Toy family ``family`` (``exportlm.models.tiny_hf_model``) saved in bf16 under ``root / "src"``."""
    from exportlm.models import tiny_hf_model

    model = tiny_hf_model(family, seed=seed).to(torch.bfloat16)
    directory = root / "src"
    model.save_pretrained(directory, max_shard_size="100KB")
    return directory


def different_files(a: Path, b: Path, *, skip: tuple[str, ...] = ()) -> list[str]:
    """Names of the files whose bytes differ between directories ``a`` and ``b`` (or exist in one)."""
    names = {p.name for p in a.iterdir()} | {p.name for p in b.iterdir()}
    return sorted(
        n
        for n in names
        if n not in skip
        and (
            not (a / n).is_file()
            or not (b / n).is_file()
            or (a / n).read_bytes() != (b / n).read_bytes()
        )
    )


def without_tensor(directory: Path, name: str) -> None:
    """Rewrite ``directory``'s sharded checkpoint without tensor ``name`` (shard and index)."""
    import json

    from safetensors.torch import load_file, save_file

    index = directory / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    shard = directory / meta["weight_map"].pop(name)
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    index.write_text(json.dumps(meta, indent=2))


MANIFEST = "exportlm-manifest.json"


def in_memory_export(
    src: Path, out: Path, recipe: Any, *, shard: str, format: str = "modelopt"
) -> Path:
    """The in-memory export of ``src`` (quantized with ``recipe``) the stream must equal."""
    from exportlm import export_model
    from exportlm.cli._model import resolve_model
    from exportlm.quant import QuantRecipe, quantize

    model = resolve_model(str(src)).build()
    if recipe is not None:  # with the layout's scale convention, as the stream picks it
        model = quantize(model, QuantRecipe.parse(recipe).for_layout(format))
    options = {} if format == "modelopt" else {"format": format}  # as the stream records them
    return export_model("hf_checkpoint", model, out, max_shard_size=shard, **options)


def assert_same_checkpoint(a: Path, b: Path) -> None:
    """Every file but the manifest byte for byte; the manifests list the same digests."""
    import json

    assert different_files(a, b, skip=(MANIFEST,)) == []
    ours, theirs = (json.loads((d / MANIFEST).read_text()) for d in (a, b))
    # every file's digest is the same; the streamed manifest has no model hash (never whole)
    assert ours["files"] == theirs["files"]
    assert ours["options"] == theirs["options"]
    assert theirs["model_blake3"] is None
