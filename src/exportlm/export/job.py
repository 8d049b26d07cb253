"""The export pipeline, written once: one :class:`ExportRequest` in, one job, one artifact out.

:func:`run_export` is what ``export_model`` does once it has looked the target up: it runs
the target's ``accepts`` and hands the request to the target. A built-in target is a body
declared with :func:`job_target`; it runs inside :func:`export_job`, which, once per export,

1. checks the model is an ``nn.Module`` (and, when ``export_model`` has not already,
   that the target ``accepts`` it) and has real weights; resolves ``example_inputs``
   (:class:`~exportlm.errors.InvalidModelError` / ``InvalidInputError`` before
   anything is written); reads the vocabulary once, for the inputs and the manifest;
2. stages the artifact (a file or a directory, as the target declares) through
   :func:`~exportlm.atomic.atomic_output`, with the artifact's
   :class:`~exportlm.export.guard.PendingManifest` written just before publishing, so a
   failure leaves no partial artifact and an existing one untouched;
3. for a traced target: puts the model in its traceable state (eval mode, traceable MoE
   experts) and restores it, hides exporter noise (one log line instead of a flood), and
   turns any exporter failure into :class:`~exportlm.errors.ExportFailedError` chaining
   the cause, except that an ``InvalidModelError`` / ``InvalidInputError`` raised from
   inside the traced forward surfaces as itself.

The ``hf_checkpoint`` target's two sources of weights, the model in memory and a model
directory streamed layer by layer (``streamed=True``: a ``meta`` skeleton, no weight
check, no model hash), both publish through :func:`export_job`: one manifest, one
atomic publish.

A factory exportlm does not run (a third-party target) gets the same checks around it,
and its manifest after it returns (:meth:`~exportlm.export.guard.PendingManifest.finish`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from exportlm.atomic import atomic_output, check_output_path
from exportlm.errors import (
    ArtifactIntegrityError,
    ExportFailedError,
    InvalidInputError,
    InvalidModelError,
    OutputExistsError,
)
from exportlm.export._moe import TRACEABLE_EXPERTS, traceable_model
from exportlm.export._quiet import CapturedNoise, quiet_exporter
from exportlm.export.declaration import TargetInfo, declare
from exportlm.export.guard import PendingManifest, check_real_weights
from exportlm.inputs import infer_vocab_size, resolve_example_inputs

__all__ = ["ExportJob", "ExportRequest", "export_job", "job_target", "run_export"]

#: ``body(request, **options) -> Path``: a target that runs inside :func:`export_job`.
JobBody = Callable[..., Path]
_BODY_ATTR = "__exportlm_job_body__"


@dataclass(frozen=True)
class ExportRequest:
    """One export as asked for.

    Attributes:
        info: the target, as registered (its name is the manifest's ``target``).
        model: the user's model.
        output_path: where the artifact is published.
        recorded: the options the manifest records: what ``export_model`` was given;
            ``None`` when the target is called directly and records its own.
        accepted: ``export_model`` already ran ``info.accepts`` on the model.
    """

    info: TargetInfo
    model: Any
    output_path: Path
    recorded: Mapping[str, Any] | None = None
    accepted: bool = False


@dataclass
class ExportJob:
    """One export in progress, handed to the target's body by :func:`export_job`.

    Attributes:
        info: the target, as registered.
        model: the user's model, in its traceable state until the job exits.
        inputs: resolved example inputs; ``inputs[0]`` is ``input_ids`` (int64 [batch, seq]);
            empty for a target that traces nothing.
        staged: where the target writes its artifact; moved into place on success.
        noise: exporter output and warnings captured so far.
        manifest: the artifact's manifest, written when the job publishes.
    """

    info: TargetInfo
    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    staged: Path
    noise: CapturedNoise
    manifest: PendingManifest

    @property
    def target(self) -> str:
        """The target's name, for messages."""
        return self.info.name


def job_target(info: TargetInfo) -> Callable[[JobBody], Callable[..., Path]]:
    """Declare ``body(request, **options)`` as the export factory of target ``info``.

    The factory is ``(model, output_path, **options) -> Path`` with the body's options
    as its signature, declared with ``info``; called directly it runs the body with a
    request for ``info``. :func:`run_export` hands the body its own request instead
    (the target as registered, the options as given, ``accepts`` already run).
    """

    def decorate(body: JobBody) -> Callable[..., Path]:
        @functools.wraps(body)
        def factory(model: Any, output_path: str | os.PathLike[str], **options: Any) -> Path:
            return body(ExportRequest(info, model, Path(output_path)), **options)

        params = list(inspect.signature(body).parameters.values())[1:]
        positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
        head = [inspect.Parameter(n, positional) for n in ("model", "output_path")]
        # The signature is the factory's; __wrapped__ (the body) stays, so its annotations
        # resolve in the body's module (typing.get_type_hints follows it).
        factory.__signature__ = inspect.Signature([*head, *params], return_annotation=Path)  # type: ignore[attr-defined]
        setattr(factory, _BODY_ATTR, body)
        return declare(factory, info)

    return decorate


def _accept(info: TargetInfo, model: Any) -> None:
    reason = info.accepts(model) if info.accepts is not None else None
    if reason:
        raise InvalidModelError(f"export target {info.name!r} cannot export this model: {reason}")


def _vocab_size(model: Any) -> int | None:
    try:
        return infer_vocab_size(model)
    except Exception:  # any model: an unknown vocabulary is simply not recorded
        return None


def _pending(
    request: ExportRequest, options: Mapping[str, Any], streamed: bool = False
) -> PendingManifest:
    """The checks every export makes once, and the manifest they end in.

    ``streamed``: the model is a ``meta``-device skeleton whose weights are read part by
    part (the ``hf_checkpoint`` stream): nothing to check, and it is never whole to hash.
    """
    if not streamed:
        check_real_weights(request.model, request.info.name)
    return PendingManifest(
        info=request.info,
        model=None if streamed else request.model,
        options=dict(options if request.recorded is None else request.recorded),
        vocab_size=_vocab_size(request.model),
        destination=Path(os.path.abspath(request.output_path)),
    )


def run_export(
    info: TargetInfo,
    factory: Callable[..., Any],
    model: Any,
    output_path: Path,
    options: Mapping[str, Any],
) -> Path:
    """Export ``model`` with ``factory``, the target ``info`` as registered (``export_model``'s core).

    ``accepts`` runs first. A :func:`job_target` gets the request; any other factory is
    called between the same checks and the manifest written after it.
    """
    _accept(info, model)
    check_output_path(output_path)
    request = ExportRequest(info, model, output_path, recorded=dict(options), accepted=True)
    body = getattr(factory, _BODY_ATTR, None)
    if body is not None:
        return Path(body(request, **options))
    pending = _pending(request, options)
    result = Path(factory(model, output_path, **options))
    pending.finish(result)
    return result


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
    request: ExportRequest,
    example_inputs: Any = None,
    *,
    options: Mapping[str, Any],
    traced: bool = True,
    experts: str | None = TRACEABLE_EXPERTS,
    hint: str = "",
    companions: Sequence[str] = (),
    overwrite: bool = True,
    streamed: bool = False,
) -> Iterator[ExportJob]:
    """Run one export of ``request``; see the module docstring.

    Args:
        request: the target, model and destination.
        example_inputs: as :func:`exportlm.inputs.resolve_example_inputs` takes them.
        options: the target's options, recorded in the manifest when the target is
            called directly (``export_model`` records what it was given).
        traced: ``False`` for a target that traces nothing (a weights writer): no inputs,
            no tracing state, no noise capture, and its errors surface as they are.
        experts: transformers MoE experts implementation during the export
            (``None`` leaves it alone, e.g. for scripting).
        hint: appended to the :class:`ExportFailedError` message (what to try).
        companions: glob patterns of sibling files that belong to the artifact
            (see :func:`~exportlm.atomic.atomic_output`).
        overwrite: replace an existing non-empty directory (directory artifacts).
        streamed: ``request.model`` is the ``meta``-device skeleton of a checkpoint the
            target reads layer by layer (``hf_checkpoint``'s stream source): no weight
            check, and the manifest records no model hash (``model_blake3: null``).
    """
    info, model = request.info, request.model
    if not request.accepted:
        _accept(info, model)
    if not isinstance(model, nn.Module):
        raise InvalidModelError(
            f"export target {info.name!r} expects a torch.nn.Module whose forward(input_ids) "
            f"returns logits, got {type(model).__name__}"
        )
    recorded = {"example_inputs": example_inputs, **options} if traced else options
    manifest = _pending(request, recorded, streamed)
    staging = atomic_output(
        request.output_path,
        directory=info.artifact == "directory",
        overwrite=overwrite,
        companions=companions,
        before_publish=manifest.hook,
    )
    if not traced:
        with staging as staged:
            yield ExportJob(info, model, (), staged, CapturedNoise(), manifest)
        return
    inputs = resolve_example_inputs(model, example_inputs, vocab_size=manifest.vocab_size)
    try:
        with staging as staged, quiet_exporter(info.name) as noise, traceable_model(model, experts):
            yield ExportJob(info, model, inputs, staged, noise, manifest)
    except (*_INPUT_ERRORS, OutputExistsError, ArtifactIntegrityError):
        raise
    except Exception as err:
        user_error = _user_error_in_chain(err)
        if user_error is not None:
            raise user_error from None
        raise ExportFailedError(
            f"{info.name} export of {type(model).__name__} failed in the exporter: "
            f"{type(err).__name__}: {_first_line(err)}. Nothing was written to "
            f"{request.output_path} and any previous artifact there is unchanged."
            f"{' ' + hint if hint else ''} The full exporter error is chained below."
        ) from err
