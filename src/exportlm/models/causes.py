"""Why a toy family fails some export targets, declared by cause, not by target name.

A family declares :class:`FailureCause` records: *what* in its forward cannot be
captured (``"data-dependent control flow in the expert loop"``), under *which*
ways of capturing a model (the ``capture`` an export target declares in its
``TargetInfo``: ``"torch.export"``, ``"torchscript-trace"``, ``"torchscript-script"``, ...)
and the measured error. The conformance suite crosses every family's causes with
every target's capture: a third-party target that captures with ``torch.export``
inherits the same declared failure as the built-in ``torch_export`` and ``onnx``
targets, with the family's reason, without either side naming the other.

This module holds the records and the causes the built-in families (and plugin
families built on them) share; it imports nothing of exportlm.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "PER_MODEL_CHECKS",
    "FailureCause",
    "checked_causes",
]

#: The per-model target checks (``check[target-model-device]``) a cause covers by default.
PER_MODEL_CHECKS: tuple[str, ...] = ("roundtrip_logits", "dynamic_shapes", "generation_parity")


@dataclass(frozen=True)
class FailureCause:
    """One reason a family's forward cannot go through some ways of capturing a model.

    Attributes:
        cause: what in the forward defeats the capture, in a few words
            (``"data-dependent control flow in the expert loop"``).
        captures: the ``TargetInfo.capture`` values it fails under.
        reason: the measured error, as the declared failure's reason.
        checks: the per-model checks whose items of this family fail
            (default :data:`PER_MODEL_CHECKS`).
        shared_checks: checks that are not run per model but export this family
            (or models built like it) on every target row, e.g. the model-free
            target checks that export ``decoder``; their items ``check[<row>-*]``
            fail too.
    """

    cause: str
    captures: frozenset[str]
    reason: str
    checks: tuple[str, ...] = PER_MODEL_CHECKS
    shared_checks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.captures, str):
            raise TypeError(
                f"FailureCause {self.cause!r}: captures must be a collection of capture "
                f"names, not the string {self.captures!r}"
            )
        object.__setattr__(self, "captures", frozenset(self.captures))
        texts = (self.cause, self.reason, *self.captures, *self.checks, *self.shared_checks)
        if not all(isinstance(t, str) and t.strip() for t in texts) or not self.captures:
            raise TypeError(
                f"FailureCause {self.cause!r}: cause, reason, captures and check ids must be "
                "non-empty strings, with at least one capture"
            )

    def fails_under(self, capture: str) -> bool:
        """Whether a target that captures with ``capture`` fails on this cause."""
        return capture in self.captures


def checked_causes(owner: str, declared: object) -> tuple[FailureCause, ...]:
    """``declared`` as a tuple of :class:`FailureCause`; anything else is a ``TypeError``."""
    if isinstance(declared, FailureCause):
        return (declared,)
    if isinstance(declared, (str, bytes)) or not isinstance(declared, Iterable):
        raise TypeError(f"{owner}: causes must be FailureCause records, got {declared!r}")
    causes = tuple(declared)
    if not all(isinstance(c, FailureCause) for c in causes):
        raise TypeError(f"{owner}: causes must be FailureCause records, got {causes!r}")
    return causes
