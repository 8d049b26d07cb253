"""The steps every built-in export target shares, written once: one export job.

An export runs inside :func:`export_job`, which

1. checks the model is an ``nn.Module`` and resolves ``example_inputs``
   (:class:`~exportlm.errors.InvalidModelError` / ``InvalidInputError`` before
   anything is written);
2. writes the artifact's manifest (:mod:`~exportlm.export.manifest`) last, and
   stages the artifact through :func:`~exportlm.atomic.atomic_output`, so a
   failure leaves no partial file and an existing artifact untouched;
3. puts the model in its traceable state (eval mode, traceable MoE experts) and
   restores it;
4. hides exporter noise (one log line instead of a flood);
5. turns any exporter failure into :class:`~exportlm.errors.ExportFailedError`
   chaining the cause, except that an ``InvalidModelError`` / ``InvalidInputError``
   raised from inside the traced forward (e.g. a forward without logits) surfaces
   as itself, even when the exporter wrapped it in its own exception.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from exportlm.atomic import atomic_output
from exportlm.errors import (
    ArtifactIntegrityError,
    ExportFailedError,
    InvalidInputError,
    InvalidModelError,
    OutputExistsError,
)
from exportlm.export._moe import TRACEABLE_EXPERTS, traceable_model
from exportlm.export._quiet import CapturedNoise, quiet_exporter
from exportlm.export.guard import check_real_weights, manifest_for_export
from exportlm.export.targets import get_target_info
from exportlm.inputs import resolve_example_inputs

__all__ = ["ExportJob", "export_job"]


@dataclass
class ExportJob:
    """One export in progress, handed to the target's body by :func:`export_job`.

    Attributes:
        target: the target's name, for messages.
        model: the user's model, in its traceable state until the job exits.
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


#: Terminal colour codes (torch.onnx colours its step numbers): no place in a message.
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def _first_line(err: BaseException) -> str:
    text = _ANSI_ESCAPE.sub("", str(err)).strip()
    return text.splitlines()[0] if text else type(err).__name__


@contextlib.contextmanager
def export_job(
    target: str,
    model: Any,
    output_path: str | os.PathLike[str],
    example_inputs: Any = None,
    *,
    experts: str | None = TRACEABLE_EXPERTS,
    hint: str = "",
    options: Mapping[str, Any] | None = None,
    companions: Sequence[str] = (),
) -> Iterator[ExportJob]:
    """Run one export of ``model`` to ``output_path``; see the module docstring.

    Args:
        target: the target's name, for messages.
        model: the user's model; an ``nn.Module`` or :class:`InvalidModelError`.
        output_path: the artifact file; the job's ``staged`` path moves there on success.
        example_inputs: as :func:`exportlm.inputs.resolve_example_inputs` takes them.
        experts: transformers MoE experts implementation during the export
            (``None`` leaves it alone, e.g. for scripting).
        hint: appended to the :class:`ExportFailedError` message (what to try).
        options: the target's options, recorded in the manifest when the target
            function is called directly (``export_model`` records its own).
        companions: glob patterns of sibling files that belong to the artifact
            (see :func:`~exportlm.atomic.atomic_output`).
    """
    if not isinstance(model, nn.Module):
        raise InvalidModelError(
            f"export target {target!r} expects a torch.nn.Module whose forward(input_ids) "
            f"returns logits, got {type(model).__name__}"
        )
    check_real_weights(model, target)
    inputs = resolve_example_inputs(model, example_inputs)
    recorded = {"example_inputs": example_inputs, **(options or {})}
    try:
        with (
            manifest_for_export(get_target_info(target), model, output_path, recorded),
            atomic_output(output_path, companions=companions) as staged,
            quiet_exporter(target) as noise,
            traceable_model(model, experts),
        ):
            yield ExportJob(target, model, inputs, staged, noise)
    except (*_INPUT_ERRORS, OutputExistsError, ArtifactIntegrityError):
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
