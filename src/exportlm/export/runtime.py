"""What the torch-based runtimes share: device resolution, input validation, the callable.

A runtime loader returns ``input_ids -> logits``. The ``torchscript`` and
``torch_export`` loaders wrap their loaded module in :class:`TorchModuleRuntime`;
every runtime (``onnx`` too) validates its ``input_ids`` with
:func:`check_runtime_inputs`, exactly as export validates example inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from exportlm.errors import InvalidInputError, RuntimeUnavailableError
from exportlm.export._wrapper import extract_logits
from exportlm.inputs import resolve_example_inputs

__all__ = ["TorchModuleRuntime", "check_runtime_inputs", "resolve_device"]


def resolve_device(device: str | torch.device, runtime: str) -> torch.device:
    """``device`` as a ``torch.device``; :class:`RuntimeUnavailableError` when absent here.

    ``runtime`` names the runtime in messages.

    Raises:
        InvalidInputError: ``device`` is not a device string.
        RuntimeUnavailableError: ``device`` is CUDA and this machine has none.
    """
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise InvalidInputError(
            f"{runtime} runtime: {device!r} is not a device; expected 'cpu', 'cuda' or 'cuda:N'"
        ) from err
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeUnavailableError(
            f"{runtime} runtime: device {device!r} requested but CUDA is not available on this "
            "machine (torch.cuda.is_available() is False); load with device='cpu'"
        )
    return resolved


_NO_MODEL = nn.Module()


def check_runtime_inputs(
    input_ids: Any, runtime: str, vocab_size: int | None = None
) -> torch.Tensor:
    """Validate runtime ``input_ids``: integer, 2-D, non-empty, inside the vocabulary when known.

    Returns the ids as a tensor; raises :class:`InvalidInputError` naming ``runtime``,
    the problem and the fix.
    """
    try:
        ids = resolve_example_inputs(_NO_MODEL, input_ids)[0]
    except InvalidInputError as err:
        raise InvalidInputError(f"{runtime} runtime: {err}") from err
    if ids.numel() == 0:
        raise InvalidInputError(
            f"{runtime} runtime: input_ids of shape {tuple(ids.shape)} hold no tokens; "
            "pass at least one sequence of at least one token id [batch >= 1, seq >= 1]"
        )
    if vocab_size is not None:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise InvalidInputError(
                f"{runtime} runtime: token id {bad} is outside the vocabulary [0, {vocab_size}); "
                "tokenize with the model's own tokenizer, or clip/mask ids to the vocabulary"
            )
    return ids


class TorchModuleRuntime:
    """A loaded torch artifact as ``input_ids -> logits``, run without autograd on one device.

    Attributes:
        module: the loaded ``torch.jit.ScriptModule`` or ``torch.export`` module.
        device: where inputs are moved before the call.
        runtime: the runtime's name, for messages.
        vocab_size: the vocabulary, when known; ids outside it are refused.
    """

    def __init__(
        self,
        module: Callable[..., Any],
        device: torch.device,
        runtime: str,
        vocab_size: int | None = None,
    ) -> None:
        self.module = module
        self.device = device
        self.runtime = runtime
        #: Ids at or above it are refused (set from the manifest by ``load_exported``).
        self.vocab_size = vocab_size

    def __call__(self, input_ids: Any) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` for ``input_ids`` ``[batch, seq]``."""
        ids = check_runtime_inputs(input_ids, self.runtime, self.vocab_size).to(self.device)
        with torch.no_grad():
            out = self.module(ids)
        return extract_logits(out, where=f"{self.runtime} artifact")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(runtime={self.runtime!r}, device={self.device})"
