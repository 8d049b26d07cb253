"""The options a check sees (``case.options``): one typed record, built by the suite and the API.

Both the ``pytest --export-*`` suite and ``parametrize_with_checks`` build a
:class:`CaseOptions` for each item (see :func:`case_options`), so a check sees the
same options for the same item whichever way it runs. It reads as a read-only
mapping too (``case.options["models"]``, ``case.options.get("expected_failure")``),
the way checks read options by key. Pure: imports only the standard library.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["CaseOptions", "case_options"]


@dataclass(frozen=True)
class CaseOptions(Mapping[str, Any]):
    """What a check may read of the run's options.

    Attributes:
        models: the toy families of the run (``"all"`` or ``"a,b"``); exporter
            checks survey these.
        device: the item's device (``"cpu"`` or ``"cuda"``).
        require_device: fail, instead of skip, when the device is missing.
        expected_failure: the reason the item is an expected failure, or ``None``.
        engines: ``--export-engine`` values (``NAME=PATH``) for the ``served`` check.
        require_engines: fail, instead of skip, when an engine has no interpreter.
        quantize: ``--export-quantize`` recipes the quantized checks (per model, and
            the module-exporter survey) use instead of their own lists (empty: their own).
    """

    models: str = "all"
    device: str = "cpu"
    require_device: bool = False
    expected_failure: str | None = None
    engines: tuple[str, ...] = ()
    require_engines: bool = False
    quantize: tuple[str, ...] = ()

    def __getitem__(self, key: str) -> Any:
        if key not in _KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_KEYS)

    def __len__(self) -> int:
        return len(_KEYS)


_KEYS = tuple(f.name for f in fields(CaseOptions))


def case_options(
    models: str | Iterable[str],
    device: str | None,
    *,
    require_device: bool = False,
    expected_failure: str | None = None,
    engines: Iterable[str] = (),
    require_engines: bool = False,
    quantize: Iterable[str] = (),
) -> CaseOptions:
    """The options of one item: ``models`` is ``"all"``, ``"a,b"`` or the families (none: all)."""
    chosen = models if isinstance(models, str) else ",".join(models)
    return CaseOptions(
        chosen or "all",
        device or "cpu",
        require_device,
        expected_failure,
        tuple(engines),
        require_engines,
        tuple(quantize),
    )
