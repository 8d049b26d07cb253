"""Decoder *structures* as small JSON-serialisable specs, and the models they build.

A :class:`ModelSpec` names a transformers family and the handful of numbers
that shape a decoder: layers, hidden size, attention heads and key/value heads
(GQA / MQA), intermediate size, vocabulary, tied or untied ``lm_head``, and for
MoE families the expert count and top-k. :func:`build_from_spec` builds it
through :func:`~exportlm.models.tiny_hf_model` (config only, seeded weights from
:func:`~exportlm.models.seeded_init_`, float32, eager attention, eval mode,
never downloaded), so a spec written to a JSON file rebuilds the same model
anywhere (``exportlm export --model spec.json``).

The conformance suite draws specs with Hypothesis
(``pytest_exportcheck.strategies.model_specs``) so export targets are checked
on vocabularies that are not multiples of 64, other layer counts and head
layouts than the fixed toy families.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from exportlm.errors import InputTooLargeError, InvalidConfigError
from exportlm.models.hf import _Family, _family, _make_config, build_from_config

if TYPE_CHECKING:
    import transformers

__all__ = [
    "DEFAULT_MAX_SPEC_BYTES",
    "MAX_SPEC_BYTES_ENV",
    "SPEC_FAMILIES",
    "SPEC_FORMAT",
    "ModelSpec",
    "build_from_spec",
]

#: ``"format"`` value of a spec written by :meth:`ModelSpec.to_dict`.
SPEC_FORMAT = "exportlm.model_spec/1"
#: family -> whether it is a mixture of experts. Dense families ignore the expert fields.
SPEC_FAMILIES: dict[str, bool] = {"llama": False, "mixtral": True, "qwen3_moe": True}
_MAX_POSITIONS = 64
#: The memory a spec's model may take by default (its estimate, :meth:`ModelSpec.estimated_bytes`).
DEFAULT_MAX_SPEC_BYTES = 2 << 30
#: The environment variable that sets another budget, in bytes.
MAX_SPEC_BYTES_ENV = "EXPORTLM_MAX_SPEC_BYTES"
#: What one built module costs beyond its parameters (Python objects; about 2.8 KB measured).
_MODULE_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The structure of a small decoder LM (see the module docstring).

    ``num_experts`` / ``num_experts_per_tok`` are 0 for the dense ``llama``
    family and at least 1 for ``mixtral`` / ``qwen3_moe`` (whose
    ``intermediate_size`` is the size of one expert).
    """

    family: str = "llama"
    vocab_size: int = 97
    hidden_size: int = 32
    num_layers: int = 1
    num_heads: int = 2
    num_kv_heads: int = 1
    intermediate_size: int = 64
    tie_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0

    _INT_FIELDS: ClassVar[tuple[str, ...]] = (
        "vocab_size",
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "intermediate_size",
        "num_experts",
        "num_experts_per_tok",
    )

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise InvalidConfigError("invalid model spec: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Why this spec cannot build a model (empty when it can)."""
        out: list[str] = []
        if self.family not in SPEC_FAMILIES:
            out.append(f"family {self.family!r} is not one of {sorted(SPEC_FAMILIES)}")
        for name in self._INT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                out.append(f"{name} must be an integer, got {value!r}")
        if not isinstance(self.tie_embeddings, bool):
            out.append(f"tie_embeddings must be true or false, got {self.tie_embeddings!r}")
        if out:
            return out
        for name in self._INT_FIELDS[:6]:  # all but the expert counts, checked below
            if getattr(self, name) < 1:
                out.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if out:
            return out
        if self.hidden_size % self.num_heads:
            out.append(f"num_heads={self.num_heads} does not divide hidden_size={self.hidden_size}")
        elif (self.hidden_size // self.num_heads) % 2:
            out.append(
                f"head_dim = hidden_size / num_heads = {self.hidden_size // self.num_heads} "
                "must be even (rotary embeddings rotate pairs)"
            )
        if self.num_heads % self.num_kv_heads:
            out.append(
                f"num_kv_heads={self.num_kv_heads} does not divide num_heads={self.num_heads}"
            )
        if SPEC_FAMILIES.get(self.family, False):
            if self.num_experts < 1:
                out.append(f"a {self.family} spec needs num_experts >= 1, got {self.num_experts}")
            if not 1 <= self.num_experts_per_tok <= max(self.num_experts, 1):
                out.append(
                    f"num_experts_per_tok must be in 1..num_experts={self.num_experts}, "
                    f"got {self.num_experts_per_tok}"
                )
        elif self.num_experts or self.num_experts_per_tok:
            out.append(
                f"the dense family {self.family!r} takes num_experts=0 and "
                f"num_experts_per_tok=0, got {self.num_experts} and {self.num_experts_per_tok}"
            )
        return out

    @property
    def is_moe(self) -> bool:
        """Whether the spec is a mixture of experts."""
        return SPEC_FAMILIES[self.family]

    @property
    def head_dim(self) -> int:
        """``hidden_size // num_heads``."""
        return self.hidden_size // self.num_heads

    def parameter_count(self) -> int:
        """About how many parameters the built model has (embeddings, layers, experts, norms)."""
        hidden, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attention = 2 * hidden * hidden + 2 * hidden * kv + 2 * self.head_dim
        mlp = 3 * hidden * self.intermediate_size * max(self.num_experts, 1)
        layer = attention + mlp + hidden * self.num_experts + 2 * hidden
        embeddings = self.vocab_size * hidden * (1 if self.tie_embeddings else 2)
        return embeddings + self.num_layers * layer + hidden

    def estimated_bytes(self) -> int:
        """About how much memory the built model takes: float32 parameters and its modules."""
        modules = 4 + self.num_layers * (14 + 5 * self.num_experts)
        return 4 * self.parameter_count() + _MODULE_BYTES * modules

    def to_dict(self) -> dict[str, Any]:
        """The JSON-compatible form, with ``"format"`` first; :meth:`from_dict` reads it back."""
        return {"format": SPEC_FORMAT, **dataclasses.asdict(self)}

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON with a trailing newline."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        """A spec from :meth:`to_dict`'s form; unknown or missing keys raise :class:`InvalidConfigError`."""
        if not isinstance(data, Mapping):
            raise InvalidConfigError(
                f"a model spec is a JSON object of its fields, got {type(data).__name__}"
            )
        fields = [f.name for f in dataclasses.fields(cls)]
        values = dict(data)
        fmt = values.pop("format", SPEC_FORMAT)
        if fmt != SPEC_FORMAT:
            raise InvalidConfigError(
                f"model spec format {fmt!r} is not supported; expected {SPEC_FORMAT!r}"
            )
        unknown = sorted(set(values) - set(fields))
        missing = [f for f in fields if f not in values]
        if unknown or missing:
            parts = []
            if unknown:
                parts.append(f"unknown key(s) {unknown}")
            if missing:
                parts.append(f"missing key(s) {missing}")
            raise InvalidConfigError(
                f"invalid model spec: {'; '.join(parts)}; the keys are {['format', *fields]}"
            )
        return cls(**values)

    def config_overrides(self) -> dict[str, Any]:
        """The transformers config values of this spec (over ``tiny_hf_model``'s defaults)."""
        overrides: dict[str, Any] = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": _MAX_POSITIONS,
            "tie_word_embeddings": self.tie_embeddings,
        }
        if self.family == "mixtral":
            overrides |= {
                "num_local_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
            }
        elif self.family == "qwen3_moe":
            overrides |= {
                "moe_intermediate_size": self.intermediate_size,
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
            }
        return overrides


def build_from_spec(
    spec: ModelSpec | Mapping[str, Any], seed: int = 0
) -> transformers.PreTrainedModel:
    """The model of ``spec`` (a :class:`ModelSpec` or its :meth:`~ModelSpec.to_dict` form).

    Built like the tiny families of :func:`~exportlm.models.tiny_hf_model`:
    from the config alone, float32, eager attention, eval mode, weights from
    :func:`~exportlm.models.seeded_init_` with ``seed``; nothing is downloaded.
    A tied spec shares one ``lm_head`` / ``embed_tokens`` parameter. Raises
    :class:`~exportlm.errors.InvalidConfigError` for an invalid spec, and
    :class:`~exportlm.errors.InputTooLargeError` before allocating anything when
    the model's :meth:`~ModelSpec.estimated_bytes` exceed the budget
    (:data:`DEFAULT_MAX_SPEC_BYTES`, 2 GiB; ``EXPORTLM_MAX_SPEC_BYTES`` sets another).
    """
    if not isinstance(spec, ModelSpec):
        spec = ModelSpec.from_dict(spec)
    _check_budget(spec)
    base = _family(spec.family)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The spec's values go into the family's tiny config as its own values (not as
    # validated overrides): Qwen3-MoE's default config has no ``head_dim`` attribute
    # to override, yet reads one when the config carries it.
    config = _make_config(
        _Family(base.config_class, {**base.config, **spec.config_overrides()}), {}
    )
    return build_from_config(config, seed, f"spec:{spec.family}")


def _max_spec_bytes() -> int:
    raw = os.environ.get(MAX_SPEC_BYTES_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_SPEC_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise InvalidConfigError(
            f"{MAX_SPEC_BYTES_ENV}={raw!r} is not a positive number of bytes; "
            f"set it like {MAX_SPEC_BYTES_ENV}={8 << 30} (8 GiB), or unset it for "
            f"the default of {DEFAULT_MAX_SPEC_BYTES}"
        )
    return value


def _check_budget(spec: ModelSpec) -> None:
    """Refuse a spec whose model would not fit the budget, before a byte is allocated."""
    budget, need = _max_spec_bytes(), spec.estimated_bytes()
    if need <= budget:
        return
    raise InputTooLargeError(
        f"model spec {spec.family} (vocab_size={spec.vocab_size}, hidden_size="
        f"{spec.hidden_size}, num_layers={spec.num_layers}, num_experts={spec.num_experts}) "
        f"builds a model of about {need} bytes ({spec.parameter_count()} float32 parameters), "
        f"over the budget of {budget} bytes; a spec describes a toy model: make it smaller, "
        f"or set {MAX_SPEC_BYTES_ENV} to a larger number of bytes if the machine has the memory",
        what="model spec",
        size=need,
        limit=budget,
    )
