"""The steps every built-in export target shares, written once.

An export runs inside :func:`export_session`, which

1. checks the model is an ``nn.Module`` and resolves ``example_inputs``
   (:class:`~exportlm.errors.InvalidModelError` / ``InvalidInputError`` before
   anything is written);
2. stages the artifact through :func:`~exportlm.export.atomic_output`, so a
   failure leaves no partial file and an existing artifact untouched;
3. puts the model in its traceable state (:func:`traceable_model`) and restores it;
4. hides exporter noise (:func:`quiet_exporter`);
5. turns any exporter failure into :class:`~exportlm.errors.ExportFailedError`
   chaining the cause, except that an ``InvalidModelError`` / ``InvalidInputError``
   raised from inside the traced forward (e.g. a forward without logits) surfaces
   as itself, even when the exporter wrapped it in its own exception.

Runtimes share :class:`TorchModuleRuntime` and :func:`check_runtime_inputs`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from exportlm.errors import (
    ExportFailedError,
    InvalidInputError,
    InvalidModelError,
    RuntimeUnavailableError,
)
from exportlm.export._base import atomic_output
from exportlm.export._moe import TRACEABLE_EXPERTS, traceable_model
from exportlm.export._quiet import CapturedNoise, quiet_exporter
from exportlm.export._wrapper import extract_logits
from exportlm.inputs import resolve_example_inputs

__all__ = [
    "ExportJob",
    "RuntimeUnavailableError",
    "TorchModuleRuntime",
    "check_runtime_inputs",
    "export_session",
    "resolve_device",
]


@dataclass
class ExportJob:
    """One export in progress, handed to the target's body by :func:`export_session`.

    Attributes:
        target: the target's name, for messages.
        model: the user's model, in its traceable state until the session exits.
        inputs: resolved example inputs; ``inputs[0]`` is ``input_ids`` (int64 [batch, seq]).
        staged: where the target writes its artifact; moved into place on success.
        noise: exporter output and warnings captured so far.
    """

    target: str
    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    staged: Path
    noise: CapturedNoise


_INPUT_ERRORS = (InvalidModelError, InvalidInputError)


def _user_error_in_chain(err: BaseException) -> BaseException | None:
    """The first InvalidModelError / InvalidInputError in ``err``'s cause/context chain."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, _INPUT_ERRORS):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


@contextlib.contextmanager
def export_session(
    target: str,
    model: Any,
    output_path: str | os.PathLike[str],
    example_inputs: Any = None,
    *,
    experts: str | None = TRACEABLE_EXPERTS,
    hint: str = "",
) -> Iterator[ExportJob]:
    """Run one export of ``model`` to ``output_path``; see the module docstring.

    ``hint`` is appended to the :class:`ExportFailedError` message (what to try).
    """
    if not isinstance(model, nn.Module):
        raise InvalidModelError(
            f"export target {target!r} expects a torch.nn.Module whose forward(input_ids) "
            f"returns logits, got {type(model).__name__}"
        )
    inputs = resolve_example_inputs(model, example_inputs)
    try:
        with (
            atomic_output(output_path) as staged,
            quiet_exporter(target) as noise,
            traceable_model(model, experts),
        ):
            yield ExportJob(target, model, inputs, staged, noise)
    except _INPUT_ERRORS:
        raise
    except Exception as err:
        user_error = _user_error_in_chain(err)
        if user_error is not None:
            raise user_error from None
        raise ExportFailedError(
            f"{target} export of {type(model).__name__} failed in the exporter: "
            f"{type(err).__name__}: {_first_line(err)}. Nothing was written to {output_path} "
            f"and any previous artifact there is unchanged.{' ' + hint if hint else ''} "
            "The full exporter error is chained below."
        ) from err


# ----------------------------------------------------------------------------- runtimes


def resolve_device(device: str | torch.device, runtime: str) -> torch.device:
    """``device`` as a ``torch.device``; :class:`RuntimeUnavailableError` when absent here."""
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


def check_runtime_inputs(input_ids: Any, runtime: str) -> torch.Tensor:
    """Validate runtime ``input_ids`` (integer, 2-D) exactly as export validates example inputs."""
    try:
        return resolve_example_inputs(_NO_MODEL, input_ids)[0]
    except InvalidInputError as err:
        raise InvalidInputError(f"{runtime} runtime: {err}") from err


class TorchModuleRuntime:
    """A loaded torch artifact as ``input_ids -> logits``, run without autograd on one device.

    Attributes:
        module: the loaded ``torch.jit.ScriptModule`` or ``torch.export`` module.
        device: where inputs are moved before the call.
    """

    def __init__(self, module: Callable[..., Any], device: torch.device, runtime: str) -> None:
        self.module = module
        self.device = device
        self.runtime = runtime

    def __call__(self, input_ids: Any) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` for ``input_ids`` ``[batch, seq]``."""
        ids = check_runtime_inputs(input_ids, self.runtime).to(self.device)
        with torch.no_grad():
            out = self.module(ids)
        return extract_logits(out, where=f"{self.runtime} artifact")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(runtime={self.runtime!r}, device={self.device})"
