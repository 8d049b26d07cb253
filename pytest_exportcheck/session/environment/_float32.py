"""TF32 off while a run that selects CUDA lasts: :class:`Float32Precision`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Float32Precision"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Float32Settings:
    """torch's float32 matmul / cuDNN settings, read and written through one API.

    ``api`` is ``"legacy"`` (``allow_tf32`` and ``set_float32_matmul_precision``) or,
    where torch refuses to read the legacy flags because the new
    ``fp32_precision`` attributes were set, ``"fp32_precision"``.
    """

    api: str
    values: tuple[Any, ...]


#: The new-API attributes (owner path, attribute) saved and restored as they are.
_FP32_PRECISION_ATTRS = (
    ("", "fp32_precision"),
    ("cuda.matmul", "fp32_precision"),
    ("cudnn", "fp32_precision"),
    ("cudnn.conv", "fp32_precision"),
    ("cudnn.rnn", "fp32_precision"),
)


def _backend(path: str) -> Any:
    import torch

    owner: Any = torch.backends
    for part in filter(None, path.split(".")):
        owner = getattr(owner, part)
    return owner


def _read_float32_settings() -> _Float32Settings:
    import torch

    try:
        return _Float32Settings(
            "legacy",
            (
                torch.backends.cuda.matmul.allow_tf32,
                torch.backends.cudnn.allow_tf32,
                torch.get_float32_matmul_precision(),
            ),
        )
    except RuntimeError:  # torch refuses legacy reads after the new API was used
        values = tuple(getattr(_backend(o), a) for o, a in _FP32_PRECISION_ATTRS)
        return _Float32Settings("fp32_precision", values)


def _write_float32_settings(settings: _Float32Settings) -> None:
    import torch

    if settings.api == "legacy":
        matmul, cudnn, precision = settings.values
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn
        torch.set_float32_matmul_precision(precision)
        return
    for (owner, attr), value in zip(_FP32_PRECISION_ATTRS, settings.values):
        setattr(_backend(owner), attr, value)


#: TF32 off everywhere: float32 matmuls and convolutions in full IEEE float32.
_STRICT = _Float32Settings("legacy", (False, False, "highest"))


class Float32Precision:
    """Turns TF32 off for a run that selects CUDA, and restores the settings afterwards.

    With TF32, CUDA float32 matmuls round their inputs to 10 mantissa bits: logits
    move by about 1e-3 relative, beyond every built-in tolerance, so a roundtrip
    would compare TF32 noise instead of the export. :meth:`start` saves torch's
    settings and sets ``torch.backends.cuda.matmul.allow_tf32 = False``,
    ``torch.backends.cudnn.allow_tf32 = False`` and
    ``torch.set_float32_matmul_precision("highest")``; :meth:`stop` writes back what
    was saved. It applies to the whole pytest process (the repo's own tests in the
    same run included), only when ``cuda`` is among ``devices`` and CUDA is
    available; otherwise nothing is touched.
    """

    def __init__(
        self, devices: tuple[str, ...], cuda_available: Callable[[], bool] | None = None
    ) -> None:
        self.devices = devices
        self._cuda_available = cuda_available
        self._saved: _Float32Settings | None = None
        self.applied = False

    @property
    def wanted(self) -> bool:
        """True when the run selects CUDA and CUDA is available."""
        if "cuda" not in self.devices:
            return False
        if self._cuda_available is not None:
            return self._cuda_available()
        import torch

        return bool(torch.cuda.is_available())

    def start(self) -> None:
        """Save the current settings and turn TF32 off (no-op unless :attr:`wanted`)."""
        if self.applied or not self.wanted:
            return
        self._saved = _read_float32_settings()
        _write_float32_settings(_STRICT)
        self.applied = True
        logger.info("exportcheck: TF32 off for the run (saved %s)", self._saved)

    def stop(self) -> None:
        """Restore the settings :meth:`start` saved (idempotent)."""
        if self._saved is not None:
            _write_float32_settings(self._saved)
        self._saved = None
        self.applied = False

    def describe(self) -> str:
        """One line for the header and the reports."""
        if self.applied:
            return (
                "TF32 off for this run (cuda.matmul.allow_tf32=False, cudnn.allow_tf32=False, "
                "float32_matmul_precision=highest); restored at the end"
            )
        if "cuda" in self.devices:
            return "CUDA not available: float32 settings untouched"
        return "no CUDA device selected: float32 settings untouched"
