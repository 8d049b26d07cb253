"""Generation with a KV cache: the runtime protocol, its shared steps, and greedy decoding.

A target declaring the ``kv_cache`` capability exports, with ``kv_cache=True``,
one graph that takes and returns past key/values (see ``docs/generation.md``).
Its loaded runtime is still ``input_ids -> logits`` and is also a
:class:`GenerationRuntime`:

* ``prefill(input_ids, attention_mask=None) -> (logits, past)``: the prompt, with an
  empty past;
* ``decode(next_ids, past, attention_mask=None) -> (logits, past)``: the next tokens
  after ``past``.

``past`` is a tuple with one ``(key, value)`` pair per layer, each
``[batch, kv_heads, positions, head_dim]``. ``attention_mask`` (``[batch, past + seq]``,
1 = token, 0 = padding) lets a batch hold left-padded prompts of different lengths;
the runtime derives the ``position_ids`` from it as transformers' ``generate`` does.
:func:`greedy_generate` decodes greedily through such a runtime, or through an eager
model with its own cache, so the two can be compared token by token and step by step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from exportlm.errors import InvalidInputError, InvalidModelError
from exportlm.export._past import (
    PastLayout,
    positions_from_mask,
    probe_past_layout,
    split_cache,
)
from exportlm.export.runtime import check_runtime_inputs

__all__ = [
    "GenerationResult",
    "GenerationRuntime",
    "PastKeyValues",
    "PastStepRuntime",
    "check_attention_mask",
    "greedy_generate",
    "kv_cache_refusal",
]

#: One ``(key, value)`` pair per layer, each ``[batch, kv_heads, positions, head_dim]``.
PastKeyValues = tuple[tuple[torch.Tensor, torch.Tensor], ...]


@runtime_checkable
class GenerationRuntime(Protocol):
    """A loaded artifact that generates: ``input_ids -> logits`` plus prefill and decode steps.

    Both steps return the logits of every input position ``[batch, seq, vocab]``
    and the past to pass to the next :meth:`decode`. ``attention_mask``, when given,
    covers the past and the new ids (``[batch, past + seq]``, 1 = token, 0 = padding).
    """

    def __call__(self, input_ids: Any) -> Any: ...

    def prefill(self, input_ids: Any, attention_mask: Any = None) -> tuple[torch.Tensor, Any]: ...

    def decode(
        self, next_ids: Any, past: Any, attention_mask: Any = None
    ) -> tuple[torch.Tensor, Any]: ...


def check_attention_mask(
    attention_mask: Any, batch: int, length: int, where: str
) -> torch.Tensor | None:
    """``attention_mask`` as int64 ``[batch, length]`` of 0 / 1, or ``None``; else InvalidInputError."""
    if attention_mask is None:
        return None
    mask = torch.as_tensor(attention_mask)
    if (
        tuple(mask.shape) != (batch, length)
        or mask.is_floating_point()
        or not bool(((mask == 0) | (mask == 1)).all())
    ):
        raise InvalidInputError(
            f"{where}: attention_mask must be 0/1 integers of shape [batch, past + seq] = "
            f"[{batch}, {length}] (1 = token, 0 = padding, covering the past too), got a "
            f"{mask.dtype} tensor of shape {list(mask.shape)}"
        )
    return mask.long().cpu()


def kv_cache_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot be exported with ``kv_cache=True``, or ``None`` when it can.

    Runs one eager probe forward with ``use_cache=True`` (see ``docs/generation.md``).
    """
    try:
        probe_past_layout(model)
    except InvalidModelError as err:
        return str(err)
    return None


class PastStepRuntime(ABC):
    """What a runtime of a past-key-values graph shares: input checks, empty past, the steps.

    A subclass runs the graph in :meth:`_step`; this class validates the ids and
    the past (:class:`~exportlm.errors.InvalidInputError` naming what was expected)
    and converts between the flat graph tensors and :data:`PastKeyValues`.

    A graph with an ``attention_mask`` input sets :attr:`takes_mask` (and
    :attr:`takes_positions` for ``position_ids``) and implements :meth:`_masked_step`;
    one without is fed unpadded batches only (a mask with a 0 is refused).

    Attributes:
        layout: ``(kv_heads, head_dim)`` per layer and the cache dtype, read from the graph.
        runtime: the runtime's name, for messages.
        vocab_size: ids at or above it are refused, when known.
    """

    #: The graph takes ``attention_mask`` ``[batch, past + seq]``.
    takes_mask: bool = False
    #: The graph takes ``position_ids`` ``[batch, seq]``.
    takes_positions: bool = False

    def __init__(self, layout: PastLayout, runtime: str, vocab_size: int | None = None) -> None:
        self.layout = layout
        self.runtime = runtime
        self.vocab_size = vocab_size

    @abstractmethod
    def _step(
        self, input_ids: torch.Tensor, past: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run the graph: ``(logits, flat present)`` for ids and the flat past."""

    def _masked_step(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None,
        past: list[torch.Tensor],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run a graph that :attr:`takes_mask`; the default has none to run."""
        raise NotImplementedError(f"{type(self).__name__} declares no attention_mask input")

    def __call__(self, input_ids: Any) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` for ``input_ids`` ``[batch, seq]`` (an empty past)."""
        return self.prefill(input_ids)[0]

    def prefill(
        self, input_ids: Any, attention_mask: Any = None
    ) -> tuple[torch.Tensor, PastKeyValues]:
        """The prompt's logits ``[batch, seq, vocab]`` and its past key/values.

        ``attention_mask`` ``[batch, seq]`` marks left padding with 0.
        """
        ids = check_runtime_inputs(input_ids, self.runtime, self.vocab_size)
        empty = [
            torch.zeros((ids.shape[0], heads, 0, dim), dtype=self.layout.dtype)
            for heads, dim in self.layout.heads
            for _ in ("key", "value")
        ]
        return self._run(ids, empty, attention_mask)

    def decode(
        self, next_ids: Any, past: Any, attention_mask: Any = None
    ) -> tuple[torch.Tensor, PastKeyValues]:
        """Logits of ``next_ids`` ``[batch, seq]`` after ``past``, and the extended past.

        ``attention_mask`` ``[batch, past + seq]`` covers the past and the new ids.
        """
        ids = check_runtime_inputs(next_ids, self.runtime, self.vocab_size)
        return self._run(ids, self._flat_past(past, int(ids.shape[0])), attention_mask)

    def _run(
        self, ids: torch.Tensor, flat: list[torch.Tensor], attention_mask: Any
    ) -> tuple[torch.Tensor, PastKeyValues]:
        batch, seq = int(ids.shape[0]), int(ids.shape[1])
        length = seq + (int(flat[0].shape[2]) if flat else 0)
        mask = check_attention_mask(attention_mask, batch, length, f"{self.runtime} runtime")
        if self.takes_mask:
            mask = mask if mask is not None else torch.ones((batch, length), dtype=torch.long)
            positions = positions_from_mask(mask, seq) if self.takes_positions else None
            logits, present = self._masked_step(ids, mask, positions, flat)
        elif mask is not None and not bool(mask.all()):
            raise InvalidInputError(
                f"{self.runtime} runtime: this graph has no attention_mask input, so it cannot "
                "run a padded batch (the mask has zeros); run each prompt alone, or export "
                "with kv_cache=True and the default attention_mask=None on a target whose "
                "graph takes one (onnx)"
            )
        else:
            logits, present = self._step(ids, flat)
        pairs = tuple((present[2 * i], present[2 * i + 1]) for i in range(len(present) // 2))
        return logits, pairs

    def _flat_past(self, past: Any, batch: int) -> list[torch.Tensor]:
        """``past`` as the graph's flat tensors, or :class:`InvalidInputError` saying what is wrong."""
        layers = self.layout.num_layers
        expected = (
            f"a tuple of {layers} (key, value) pairs, layer i of shape "
            f"[batch={batch}, kv_heads, past, head_dim] with (kv_heads, head_dim) = "
            f"{[list(h) for h in self.layout.heads]}, as prefill/decode return it"
        )
        if not isinstance(past, Sequence) or len(past) != layers:
            got = f"{len(past)} entries" if isinstance(past, Sequence) else type(past).__name__
            raise InvalidInputError(f"{self.runtime} runtime: past has {got}; expected {expected}")
        flat: list[torch.Tensor] = []
        length: int | None = None
        for i, (pair, (heads, dim)) in enumerate(zip(past, self.layout.heads, strict=True)):
            if not isinstance(pair, Sequence) or len(pair) != 2:
                raise InvalidInputError(
                    f"{self.runtime} runtime: past[{i}] is not a (key, value) pair; expected {expected}"
                )
            for kind, tensor in zip(("key", "value"), pair, strict=True):
                shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else None
                length = shape[2] if length is None and shape and len(shape) == 4 else length
                if shape is None or shape != (batch, heads, length, dim):
                    raise InvalidInputError(
                        f"{self.runtime} runtime: past[{i}] {kind} has shape "
                        f"{list(shape) if shape else type(tensor).__name__}; expected "
                        f"[{batch}, {heads}, {length if length is not None else 'past'}, {dim}] "
                        f"(every layer with the same past length); past must be {expected}"
                    )
                flat.append(tensor.detach().cpu().to(self.layout.dtype))
        return flat


class _EagerGeneration:
    """An eager model as a :class:`GenerationRuntime` with its own cache object (the reference)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layout = probe_past_layout(model)
        self.where = type(model).__name__

    def _forward(self, ids: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        with torch.no_grad():
            output = self.model(ids, use_cache=True, **kwargs)
        logits, cache = split_cache(output, self.layout.style, self.where)
        return logits.detach(), cache

    def __call__(self, input_ids: Any) -> torch.Tensor:
        return self.prefill(input_ids)[0]

    def _mask_kwargs(self, ids: torch.Tensor, attention_mask: Any, past: int) -> dict[str, Any]:
        """The forward's ``attention_mask`` / ``position_ids`` for a padding mask (none without)."""
        length = past + int(ids.shape[1])
        mask = check_attention_mask(attention_mask, int(ids.shape[0]), length, self.where)
        if mask is None:
            return {}
        if not self.layout.attention_mask:
            if bool(mask.all()):
                return {}
            raise InvalidInputError(
                f"{self.where}.forward takes no attention_mask, so it cannot run a padded batch"
            )
        kwargs: dict[str, Any] = {"attention_mask": mask.to(ids.device)}
        if self.layout.position_ids:
            kwargs["position_ids"] = positions_from_mask(mask, int(ids.shape[1])).to(ids.device)
        return kwargs

    def prefill(self, input_ids: Any, attention_mask: Any = None) -> tuple[torch.Tensor, Any]:
        ids = _model_ids(self.model, input_ids)
        return self._forward(ids, **self._mask_kwargs(ids, attention_mask, 0))

    def decode(
        self, next_ids: Any, past: Any, attention_mask: Any = None
    ) -> tuple[torch.Tensor, Any]:
        ids = _model_ids(self.model, next_ids)
        kwargs = self._mask_kwargs(ids, attention_mask, _past_length(past))
        return self._forward(ids, **{self.layout.cache_arg: past}, **kwargs)


def _past_length(past: Any) -> int:
    """The positions an eager cache holds (a transformers ``Cache`` or ``(key, value)`` pairs)."""
    length = getattr(past, "get_seq_length", None)
    if callable(length):
        return int(length())
    return int(past[0][0].shape[2])


def _model_ids(model: nn.Module, input_ids: Any) -> torch.Tensor:
    ids = check_runtime_inputs(input_ids, "eager model")
    for tensor in [*model.parameters(), *model.buffers()]:
        return ids.to(tensor.device)
    return ids


@dataclass(frozen=True)
class GenerationResult:
    """What :func:`greedy_generate` produced.

    Attributes:
        tokens: the new token ids ``[batch, max_new_tokens]`` (int64, CPU).
        step_logits: per new token, the logits it was chosen from ``[batch, vocab]``
            (float32, CPU): step 0 is the prompt's last position (prefill), step ``k``
            the ``k``-th decode step.
    """

    tokens: torch.Tensor
    step_logits: tuple[torch.Tensor, ...]

    def top2_margins(self) -> torch.Tensor:
        """Per step and row, the gap between the largest and second-largest logit ``[steps, batch]``."""
        top = torch.stack([logits.topk(2, dim=-1).values for logits in self.step_logits])
        return top[..., 0] - top[..., 1]


def greedy_generate(
    runtime_or_model: GenerationRuntime | nn.Module,
    input_ids: Any,
    max_new_tokens: int,
    *,
    attention_mask: Any = None,
) -> GenerationResult:
    """Greedy decoding of ``max_new_tokens`` tokens after the prompt ``input_ids`` ``[batch, seq]``.

    ``runtime_or_model`` is a :class:`GenerationRuntime` (an artifact exported with
    ``kv_cache=True`` and loaded with :func:`~exportlm.export.load_exported`): one
    ``prefill``, then one ``decode`` per further token, each fed the previous past;
    or an ``nn.Module`` with a KV cache, run eagerly with its own cache object
    (``use_cache=True``), which is the reference an artifact is compared with.
    Ties between equal logits go to the lowest token id (``argmax``).

    ``attention_mask`` ``[batch, seq]`` (1 = token, 0 = padding) lets the rows be
    left-padded prompts of different lengths; it is extended by one 1 per new token
    and passed to every step, so each row generates what that prompt alone would.

    Raises:
        InvalidInputError: ``input_ids`` are not integer ids ``[batch, seq]``, or
            ``max_new_tokens`` is not a positive int.
        InvalidModelError: a model without a usable KV cache, or a runtime without
            ``prefill`` / ``decode`` (export it with ``kv_cache=True``).
    """
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 1
    ):
        raise InvalidInputError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if isinstance(runtime_or_model, nn.Module):
        runner: GenerationRuntime = _EagerGeneration(runtime_or_model)
    elif isinstance(runtime_or_model, GenerationRuntime):
        runner = runtime_or_model
    else:
        raise InvalidModelError(
            f"greedy_generate needs a GenerationRuntime (prefill and decode steps) or an "
            f"nn.Module, got {type(runtime_or_model).__name__}; export with kv_cache=True "
            "and load the artifact with exportlm.load_exported"
        )
    ids = check_runtime_inputs(input_ids, "greedy_generate")
    mask = check_attention_mask(
        attention_mask, int(ids.shape[0]), int(ids.shape[1]), "greedy_generate"
    )
    logits, past = runner.prefill(input_ids, **_mask_arg(mask))
    steps: list[torch.Tensor] = []
    tokens: list[torch.Tensor] = []
    for step in range(max_new_tokens):
        last = torch.as_tensor(logits)[:, -1, :].detach().float().cpu()
        steps.append(last)
        tokens.append(last.argmax(dim=-1))
        if step + 1 < max_new_tokens:
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            logits, past = runner.decode(tokens[-1][:, None], past, **_mask_arg(mask))
    return GenerationResult(torch.stack(tokens, dim=1), tuple(steps))


def _mask_arg(mask: torch.Tensor | None) -> dict[str, Any]:
    """``attention_mask=`` only when there is one, so a runtime without the keyword still works."""
    return {} if mask is None else {"attention_mask": mask}
