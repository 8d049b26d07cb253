"""Recording module exporters: which exporter wrote which tensors for which module.

Internal to :mod:`pytest_exportcheck.checks` (used by :mod:`._survey`). A
:class:`Recorder` is the sink of ``export_quantized_state``; every exporter of
the dispatch registry copy is wrapped in a :class:`RecordingExporter`, so each
``export`` call becomes an :class:`ExportCall`: the tensor names it wrote,
whether it changed the module (the change is undone: the quantized models are
shared by every check), and the exception it raised, if any.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from exportlm.module_exporters import ExportContext, ModuleExporter
from exportlm.quant import is_quantized_module
from pytest_exportcheck.checks._common import error_text

__all__ = ["ExportCall", "Recorder", "RecordingExporter"]


@dataclass(frozen=True)
class ExportCall:
    """One ``exporter.export(name, module, ctx)`` call made by the driver.

    ``error`` is the text of the exception the call raised, ``exception`` the
    exception itself (for ``CheckResult.exception``; not compared).
    """

    exporter: str
    model: str
    recipe: str
    module_name: str
    module_type: str
    quantized: bool
    names: tuple[str, ...]
    mutated: tuple[str, ...]
    error: str | None = None
    exception: BaseException | None = field(default=None, compare=False, repr=False)


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()}


def _changed(before: Mapping[str, torch.Tensor], module: nn.Module) -> tuple[str, ...]:
    after = module.state_dict(keep_vars=True)
    changed = sorted(set(before) ^ set(after))
    for key in sorted(set(before) & set(after)):
        a, b = before[key], after[key].detach()
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            changed.append(key)
    return tuple(changed)


class Recorder:
    """Collects export calls; as the sink, attributes every tensor to the running call."""

    def __init__(self, model: str, recipe: str) -> None:
        self.model, self.recipe = model, recipe
        self.calls: list[ExportCall] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self._current: list[str] | None = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """The sink interface: ``tensor`` is written under ``name``."""
        self.tensors[name] = tensor
        if self._current is not None:
            self._current.append(name)

    @contextlib.contextmanager
    def call(self, exporter: str, name: str, module: nn.Module) -> Iterator[None]:
        """Record the export call of ``exporter`` on ``module`` (named ``name``) it wraps."""
        written: list[str] = []
        before = _state(module)
        self._current = written
        error: BaseException | None = None
        try:
            yield
        except Exception as err:
            error = err
            raise
        finally:
            self._current = None
            mutated = _changed(before, module)
            if mutated:  # undo it: the quantized models are shared by every check
                module.load_state_dict(before, strict=False)
            self.calls.append(
                ExportCall(
                    exporter,
                    self.model,
                    self.recipe,
                    name,
                    type(module).__name__,
                    is_quantized_module(module),
                    tuple(written),
                    mutated,
                    None if error is None else error_text(error),
                    error,
                )
            )


class RecordingExporter(ModuleExporter):
    """Delegates to an exporter and records its export calls (one subclass per exporter)."""

    exports_unquantized: ClassVar[bool] = False

    def __init__(self, inner: ModuleExporter, label: str, recorder: Recorder) -> None:
        self.inner, self.label, self.recorder = inner, label, recorder

    @property
    def display_name(self) -> str:
        """The wrapped exporter's name, so messages of the driver name it."""
        return self.label

    def prepare_moe_inputs(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        """Delegated as it is (nothing is written here)."""
        self.inner.prepare_moe_inputs(name, module, ctx)

    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        """Delegated, recorded by the recorder."""
        with self.recorder.call(self.label, name, module):
            self.inner.export(name, module, ctx)
