"""A local model directory as the ``hf_checkpoint`` target's source: streamed, or loaded whole.

``export_model("hf_checkpoint", DIR, out, recipe=..., stream="auto", max_memory=...)``
quantizes and exports the model saved in ``DIR``. :class:`DirectorySource` holds how
(the *source options*, which the manifest does not record: they say how the weights
were read, not what the checkpoint is). ``stream="auto"`` streams when an in-memory
export would not fit the memory bound (:func:`~.stream._budget.should_stream`); the
stream (:func:`~.stream._pipeline.stream_checkpoint`) reads one decoder layer at a
time, the in-memory source loads the model whole (as ``exportlm export --model DIR``
does), quantizes it and writes it as any model in memory. Both publish
through the export job with the one shard writer.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from exportlm.atomic import check_output_path
from exportlm.errors import InvalidOptionError, OutputExistsError
from exportlm.export.hf_checkpoint._write import CheckpointOptions, export_in_memory
from exportlm.export.job import ExportRequest

__all__ = [
    "SOURCE_OPTIONS",
    "DirectorySource",
    "ModelDirectory",
    "checked_skeleton",
    "export_directory",
    "is_model_directory",
    "meta_skeleton",
    "without_source_options",
]

#: The options that say how a model directory is read; never recorded in the manifest.
SOURCE_OPTIONS = ("stream", "max_memory", "recipe", "calibration", "calibration_inputs")
_STREAM_VALUES = (True, False, "auto")
_INPUTS = ("quantized", "float")


def is_model_directory(model: Any) -> bool:
    """Whether ``model`` names a directory (a path, not a model object)."""
    return isinstance(model, (str, os.PathLike)) and Path(model).is_dir()


@dataclass(frozen=True)
class ModelDirectory:
    """A model directory with its ``meta`` model already built (:func:`meta_skeleton`), for
    ``export_model("hf_checkpoint", ModelDirectory(...), ...)`` where a path goes: a caller
    that checked a recipe on the skeleton (``exportlm export``) hands it on, and the export
    checks it again without building a second one. An ``os.PathLike`` of the directory.
    """

    path: Path
    skeleton: Any

    def __fspath__(self) -> str:
        return os.fspath(self.path)


def without_source_options(request: ExportRequest) -> ExportRequest:
    """``request`` recording the checkpoint's options only (see the module docstring)."""
    if request.recorded is None or not set(SOURCE_OPTIONS) & set(request.recorded):
        return request
    kept = {k: v for k, v in request.recorded.items() if k not in SOURCE_OPTIONS}
    return dataclasses.replace(request, recorded=kept)


@dataclass(frozen=True)
class DirectorySource:
    """How a model directory is read and quantized (the target's source options)."""

    stream: bool | Literal["auto"] = "auto"
    max_memory: int | str | None = None
    recipe: Any = None
    calibration: Sequence[torch.Tensor] | None = None
    calibration_inputs: str = "quantized"

    def __post_init__(self) -> None:
        if self.stream not in _STREAM_VALUES:
            raise InvalidOptionError(f"stream must be True, False or 'auto', got {self.stream!r}")
        if self.calibration_inputs not in _INPUTS:
            raise InvalidOptionError(
                f"calibration_inputs must be 'quantized' or 'float', got {self.calibration_inputs!r}"
            )

    def streams(self, directory: Path) -> bool:
        """Whether ``directory`` is read layer by layer."""
        if self.stream != "auto":
            return bool(self.stream)
        from exportlm.export.hf_checkpoint.stream._budget import parse_memory, should_stream

        if self.max_memory is not None:
            parse_memory(self.max_memory)  # a malformed budget is an error either way
        return should_stream(directory, self.max_memory)

    def refuse_for_model(self) -> None:
        """A model in memory takes none of the source options (it is written as it is)."""
        given = [name for name, value in self._given().items() if value]
        if given:
            raise InvalidOptionError(
                f"{', '.join(given)}: only a model directory takes these (it is read, "
                "quantized and, when it does not fit memory, streamed here); a model in "
                "memory is written as it is: quantize it with exportlm.quant.quantize "
                "first, or pass the path of its directory"
            )

    def _given(self) -> dict[str, bool]:
        return {
            "stream=True": self.stream is True,
            "max_memory": self.max_memory is not None,
            "recipe": self.recipe is not None,
            "calibration": self.calibration is not None,
            "calibration_inputs": self.calibration_inputs != "quantized",
        }


def export_directory(
    request: ExportRequest,
    source: DirectorySource,
    options: CheckpointOptions,
    *,
    given_dtype: Any,
    tokenizer: Mapping[str, bytes] | None,
) -> Path:
    """Export the model directory ``request.model`` (see the module docstring).

    ``tokenizer``: the tokenizer files given, else (``None``) the directory's own.
    """
    from exportlm.export.hf_checkpoint.tokenizer import refuse_broken_tokenizer
    from exportlm.hfdir import tokenizer_files

    directory, out = Path(request.model), request.output_path
    check_output_path(out)
    if not options.overwrite and out.is_dir() and any(out.iterdir()):  # before any weight is read
        raise OutputExistsError(f"{out} exists and is not empty; pass overwrite=True to replace it")
    built = request.model.skeleton if isinstance(request.model, ModelDirectory) else None
    skeleton = checked_skeleton(directory, source.recipe, options.format, built)  # before reads
    files = tokenizer
    if files is None:
        files = tokenizer_files(directory)
        refuse_broken_tokenizer(files, directory)
    options = dataclasses.replace(options, tokenizer_files=files)
    if source.streams(directory):
        from exportlm.export.hf_checkpoint.stream._pipeline import stream_checkpoint

        if options.is_qlora:
            raise InvalidOptionError(
                "is_qlora: a streamed export writes the directory's modules as they are "
                "saved; export a model with LoRA adapters in memory (stream=False)"
            )
        return stream_checkpoint(request, source, options, given_dtype, skeleton)
    model = _loaded(directory, source, options.format)
    request = dataclasses.replace(request, model=model, accepted=False)
    return export_in_memory(request, options, _recorded(options, given_dtype))


def _recorded(options: CheckpointOptions, given_dtype: Any) -> dict[str, Any]:
    """The options a direct call records: those given that differ from the target's defaults."""
    values = {"format": options.format, "max_shard_size": options.max_shard_size}
    values |= {"dtype": given_dtype, "overwrite": options.overwrite}
    defaults = {"format": "modelopt", "max_shard_size": "5GB", "dtype": None, "overwrite": False}
    return {k: v for k, v in values.items() if v != defaults[k]}


def checked_skeleton(directory: Path, recipe: Any, format: str, skeleton: Any = None) -> Any:
    """Refuse what :func:`~exportlm.quant.quantize` would refuse on the directory's model
    (the layout, a module's shape, stacked experts the recipe cannot take), from
    ``config.json`` alone: its ``meta`` skeleton (``skeleton`` where the caller built it,
    else :func:`meta_skeleton`), before a weight file is opened or a calibration forward
    runs. Returns the skeleton (the stream reads into it): ``skeleton`` without a recipe,
    ``None`` where transformers cannot build it (the load then reports why).
    """
    from exportlm.hfdir import vet_model_directory
    from exportlm.quant import QuantRecipe, check_layout, check_recipe

    if recipe is None:
        return skeleton
    plan = QuantRecipe.parse(recipe).for_layout(format)
    check_layout(plan, format)  # a layout that cannot hold it
    vet_model_directory(directory)  # no code of its own, before transformers reads the config
    if skeleton is None:
        skeleton = meta_skeleton(directory)
    if skeleton is None:
        return None
    check_recipe(skeleton, plan)
    return skeleton


def meta_skeleton(directory: Path) -> Any:
    """The directory's causal LM on the ``meta`` device, from ``config.json`` alone
    (:func:`~.stream._source.meta_model`), or ``None`` where it cannot be built (loading
    then reports why, with its context). The directory is vetted by the caller."""
    from exportlm.export.hf_checkpoint.stream._source import meta_model

    try:
        return meta_model(directory)
    except Exception:  # any failure here is reported by the real load, with its context
        return None


def _loaded(directory: Path, source: DirectorySource, format: str) -> Any:
    """The directory's model in memory (as saved, eager attention, eval), quantized by
    ``source.recipe`` (as ``exportlm export --model DIR`` loads it)."""
    from exportlm.export.hf_checkpoint.source_model import load_source_model
    from exportlm.hfdir import read_config
    from exportlm.quant import QuantRecipe, check_layout, check_layout_model_type, quantize

    if source.recipe is not None:  # a layout that cannot hold it: before the model loads
        check_layout(QuantRecipe.parse(source.recipe).for_layout(format), format)
    check_layout_model_type(read_config(directory).get("model_type"), format, str(directory))
    model = load_source_model(directory, str(directory))
    if source.recipe is None:
        return model
    plan = QuantRecipe.parse(source.recipe).for_layout(format)
    batches = source.calibration

    def calibrate(module: torch.nn.Module) -> None:
        with torch.no_grad():
            for ids in batches or ():
                module(ids)

    return quantize(model, plan, calibrate if batches is not None else None)
