"""Half-precision matmuls of a calibration, in float32 on CPUs with no half-precision GEMM.

A bfloat16 ``F.linear`` or ``torch.matmul`` on a CPU without AVX512-BF16 or AMX (AVX2
machines: AMD EPYC before Zen 4, Intel before Cooper Lake) takes a path about 9x slower
than the same product in float32: on a 2-core AVX2 AMD EPYC, ``[16384, 1536] x [1536,
576]`` took 1.69 s in bfloat16 and 0.18 s in float32 (0.22 s with both casts); float16 was
5x slower than float32. A bfloat16 model's calibration there spent most of its time in
them: the linears, the AWQ search's scoring, eager attention's two batched matmuls.

Both compute the same thing. A bfloat16 GEMM multiplies bfloat16 values (exact in
float32), accumulates in float32 and rounds the output to bfloat16; here the operands
are cast to float32, multiplied, and the output rounded to bfloat16. What differs is the
accumulation order of a kernel, as between any two CPUs (on the shapes above, 0.015% of
the outputs one bfloat16 step apart). Every other operation is untouched.

:func:`float32_matmuls` does it for the matmuls run inside it (a ``TorchFunctionMode``:
``F.linear``, ``matmul``, ``mm``, ``bmm`` and ``@`` of CPU half-precision tensors).
:func:`exportlm.quant.quantize` calibrates and searches inside it, and the streaming
export runs each layer's next inputs inside it, so streamed and in-memory calibrations
see the same activations. Exports never run inside it. ``EXPORTLM_FLOAT32_GEMM=1``
forces it on any CPU, ``0`` turns it off; unset (or ``auto``), the CPU decides.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from exportlm.errors import InvalidInputError

__all__ = ["ENV", "check_setting", "describe", "float32_matmuls", "wanted"]

ENV = "EXPORTLM_FLOAT32_GEMM"
_HALF = (torch.bfloat16, torch.float16)
#: Each takes two tensor operands first (``F.linear``: input, weight; a bias third).
_MATMULS: frozenset[Callable[..., Any]] = frozenset(
    {
        F.linear,
        torch.matmul,
        torch.mm,
        torch.bmm,
        torch.Tensor.matmul,
        torch.Tensor.mm,
        torch.Tensor.bmm,
        torch.Tensor.__matmul__,
    }
)


def _setting() -> bool | None:
    """``True`` / ``False`` from :data:`ENV`, ``None`` for the CPU to decide."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise InvalidInputError(
        f"{ENV}={os.environ[ENV]!r} is not a setting; expected 1 (half-precision matmuls of "
        "a calibration in float32), 0 (in their own dtype) or auto (the CPU decides)"
    )


def check_setting() -> None:
    """Refuse an :data:`ENV` value that is no setting (:class:`InvalidInputError`)."""
    _setting()


@functools.cache
def _cpu_has_half_gemm() -> bool:
    """Whether this CPU multiplies half-precision matrices natively (AVX512-BF16 or AMX).

    torch's own probes of the CPU; a torch without them is taken to have it (the matmuls
    then run as they always did)."""
    names = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    probes = [getattr(torch.cpu, name, None) for name in names]
    if not all(callable(probe) for probe in probes):
        return True
    return any(bool(probe()) for probe in probes)  # type: ignore[misc]


def _wanted_here() -> bool:
    setting = _setting()
    return not _cpu_has_half_gemm() if setting is None else setting


def wanted(module: nn.Module) -> bool:
    """Whether ``module`` has CPU half-precision parameters whose calibration matmuls
    :func:`float32_matmuls` would run in float32 here."""
    half = any(p.dtype in _HALF and p.device.type == "cpu" for p in module.parameters())
    return half and _wanted_here()


def describe() -> str:
    """How a calibration multiplies bfloat16 matrices here, in words (``exportlm env``)."""
    try:
        setting = _setting()
    except InvalidInputError as err:
        return str(err)
    native = _cpu_has_half_gemm()
    cpu = (
        "this CPU has AVX512-BF16 or AMX" if native else "this CPU has neither AVX512-BF16 nor AMX"
    )
    if setting is None:
        return f"calibration's in {'bf16' if native else 'float32'} ({cpu})"
    return f"calibration's in {'float32' if setting else 'bf16'} ({ENV}; {cpu})"


#: Weight elements cast to float32 at a time by :func:`float32_product` (4 MiB): a
#: linear's float32 copy would add twice its bfloat16 weight to what a streamed layer
#: holds (a 14336 x 4096 ``down_proj``: 235 MB).
WEIGHT_CHUNK = 1 << 20


def float32_product(func: Callable[..., Any], args: tuple[Any, ...]) -> torch.Tensor:
    """``func(*args)`` on float32 copies of its tensor operands, rounded to their dtype;
    ``F.linear``'s weight cast a slice of rows at a time."""
    if func is F.linear:
        return _linear(args[0], args[1], args[2] if len(args) > 2 else None)
    cast = tuple(a.float() if isinstance(a, torch.Tensor) else a for a in args)
    out: torch.Tensor = func(*cast)
    return out.to(args[0].dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows, cols = weight.shape
    step = max(1, WEIGHT_CHUNK // max(cols, 1))
    xf = x.float()
    result = x.new_empty((*x.shape[:-1], rows))  # each slice's product rounded into it
    for start in range(0, rows, step):
        end = min(rows, start + step)
        part = bias[start:end].float() if bias is not None else None
        result[..., start:end] = F.linear(xf, weight[start:end].float(), part)
    return result


def _half_operands(args: tuple[Any, ...]) -> bool:
    """Two (or, with a bias, three) CPU tensors of one half-precision dtype."""
    if len(args) < 2 or not all(isinstance(a, torch.Tensor) for a in args[:2]):
        return False
    tensors = [a for a in args if a is not None]
    if not all(isinstance(a, torch.Tensor) for a in tensors):
        return False
    dtype = tensors[0].dtype
    return dtype in _HALF and all(t.dtype == dtype and t.device.type == "cpu" for t in tensors)


class _Float32Matmuls(TorchFunctionMode):
    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _MATMULS and not kwargs and _half_operands(args):
            return float32_product(func, args)
        return func(*args, **kwargs)


@contextmanager
def float32_matmuls(module: nn.Module | None = None) -> Iterator[None]:
    """Inside, the half-precision matmuls on the CPU run in float32 where :func:`wanted`
    says so for ``module`` (else nothing changes); with no module, where the setting and
    the CPU say so."""
    if not (_wanted_here() if module is None else wanted(module)):
        yield
        return
    with _Float32Matmuls():
        yield
