"""``ModuleExporter``: the contract every per-module exporter implements."""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from exportlm.module_exporters._context import ExportContext

__all__ = ["MatchKey", "ModuleExporter", "ModulePredicate"]

#: A match key: a class (matches any class in the module's MRO) or an exact class name.
MatchKey = type | str
#: A ``module -> bool`` test an entry can add to (or use instead of) its keys.
ModulePredicate = Callable[[nn.Module], bool]


class ModuleExporter(abc.ABC):
    """Exports one kind of (quantized) module into the checkpoint being built.

    Subclasses implement :meth:`export`; MoE exporters also
    :meth:`prepare_moe_inputs`. Class attributes describe the exporter to the
    registry: they are what :meth:`ExportModuleRegistry.register
    <exportlm.module_exporters.ExportModuleRegistry.register>` uses when it is given no
    keys and no predicate, which is how entry-point exporters are registered.

    Attributes:
        name: the exporter's name in the registry and in reports (default: the class name).
        keys: match keys (classes or exact class names).
        predicate: optional ``module -> bool`` (a method or staticmethod).
        prepend: the exporter goes before the entries already registered.
        exports_unquantized: the driver also calls :meth:`export` on matching modules
            that are not quantized themselves (containers such as expert lists);
            otherwise those are written as plain tensors by the driver.
        goldens: a directory of golden files the exporter's distribution ships
            (``Path(__file__).parent / "goldens"``, listed as package data), laid out
            like a ``goldens/`` directory. The conformance suite reads a golden from
            there when the project under test has none of that name, so the
            exporter's value goldens are checked wherever it is installed.
    """

    name: ClassVar[str] = ""
    keys: ClassVar[tuple[MatchKey, ...]] = ()
    # A ``module -> bool`` callable (staticmethod or method), or None; typed Any
    # because a method and a staticmethod have different class-level signatures.
    predicate: ClassVar[Any] = None
    prepend: ClassVar[bool] = False
    exports_unquantized: ClassVar[bool] = False
    goldens: ClassVar[str | os.PathLike[str] | None] = None

    @property
    def display_name(self) -> str:
        """``name``, or the class name when ``name`` is empty."""
        return self.name or type(self).__name__

    def prepare_moe_inputs(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        """Before any tensor is written: decide shared values (default: nothing).

        MoE exporters unify the input amax of a block's experts here (into
        ``ctx.amax_overrides``) so they share one ``input_scale``. Must not modify
        ``module``.
        """
        return None

    @abc.abstractmethod
    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        """Write ``module``'s tensors under the prefix ``name`` through ``ctx.emit*``.

        For a quantized module the exporter owns the whole subtree (its children
        are not visited). Must not modify ``module``.
        """

    def conformance_model(self, seed: int) -> nn.Module | None:
        """A small model holding at least one module this exporter claims, already
        quantized and calibrated, for the conformance suite's value checks.

        Its weights and calibration must depend on ``seed`` only (use
        :func:`exportlm.quant.synthetic_calibration`), because
        ``golden_checkpoint`` compares what the exporter writes for it byte for
        byte. Default: the modules of ``conformance_examples()`` (when the exporter
        has that method) as ``examples.{i}`` of a :class:`ConformanceModel`;
        ``None`` otherwise, and then an exporter whose modules no toy model holds
        fails the value checks with a message asking for this method.
        """
        hook = getattr(self, "conformance_examples", None)
        if hook is None:
            return None
        from exportlm.module_exporters._conformance import ConformanceModel

        examples = list(hook())
        return ConformanceModel(examples) if examples else None

    def dequantized_module(
        self, module: nn.Module, tensors: Mapping[str, torch.Tensor]
    ) -> nn.Module | None:
        """A float module built from the ``tensors`` this exporter wrote for ``module``
        (names relative to the module's prefix: ``weight``, ``weight_scale``, ...).

        The value checks run it on the inputs of the fake-quantized ``module`` and
        compare the two outputs within a stated tolerance. Default: the library's
        formats (:func:`~exportlm.module_exporters.library_dequantized_module`: a linear or
        an embedding whose ``weight`` is stored in the format of its
        ``weight_quantizer``). Override it when your module computes more than
        that (an extra per-channel scale, another layout); ``None``: no reference.
        """
        from exportlm.module_exporters._conformance import library_dequantized_module

        return library_dequantized_module(module, tensors)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.display_name!r}>"


def declared_match(exporter: ModuleExporter) -> tuple[tuple[MatchKey, ...], Any, bool]:
    """``(keys, predicate, prepend)`` an exporter declares as attributes."""
    predicate = getattr(exporter, "predicate", None)
    return (
        tuple(getattr(exporter, "keys", ()) or ()),
        predicate,
        bool(getattr(exporter, "prepend", False)),
    )
