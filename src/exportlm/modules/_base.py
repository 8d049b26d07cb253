"""``ModuleExporter``: the contract every per-module exporter implements."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

if TYPE_CHECKING:
    from exportlm.modules._context import ExportContext

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
    <exportlm.modules.ExportModuleRegistry.register>` uses when it is given no
    keys and no predicate, which is how entry-point exporters are registered.

    Attributes:
        name: the exporter's name in the registry and in reports (default: the class name).
        keys: match keys (classes or exact class names).
        predicate: optional ``module -> bool`` (a method or staticmethod).
        prepend: the exporter goes before the entries already registered.
        exports_unquantized: the driver also calls :meth:`export` on matching modules
            that are not quantized themselves (containers such as expert lists);
            otherwise those are written as plain tensors by the driver.
    """

    name: ClassVar[str] = ""
    keys: ClassVar[tuple[MatchKey, ...]] = ()
    # A ``module -> bool`` callable (staticmethod or method), or None; typed Any
    # because a method and a staticmethod have different class-level signatures.
    predicate: ClassVar[Any] = None
    prepend: ClassVar[bool] = False
    exports_unquantized: ClassVar[bool] = False

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
