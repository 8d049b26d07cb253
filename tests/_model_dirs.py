"""A toy model directory as users hand one to exportlm: seeded weights, a tokenizer, a chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

WORDS = [
    "<unk>",
    "<s>",
    "</s>",
    "<|user|>",
    "<|assistant|>",
    "the",
    "a",
    "model",
    "exports",
    "well",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def toy_tokenizer() -> Any:
    """A word-level fast tokenizer with a chat template (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def toy_model_dir(root: Path, family: str = "llama", *, dtype: Any = None) -> Path:
    """Toy family ``family`` saved with ``save_pretrained`` and :func:`toy_tokenizer` in ``root``."""
    from exportlm.models import build_model

    model = build_model(family, seed=0)
    if dtype is not None:
        model = model.to(dtype)
    model.generation_config.eos_token_id = [2, 4]  # a list, as chat models declare
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(root)
    toy_tokenizer().save_pretrained(root)
    return root
