"""Golden files: JSON descriptions of exported tensors and configs, compared field by field.

A golden is ``<directory>/<name>.json``, written with sorted keys and two-space
indentation so that a diff between two goldens is readable and stable. Tensors
are described, not stored (:func:`tensor_record`): dtype, shape and the sha256
of the raw bytes (FP8 and other dtypes numpy cannot hold are read as ``uint8``),
plus the values of small tensors (scales) or a summary of large ones (absmax,
mean, count of NaN/inf). A golden is a few kilobytes and still catches one
flipped bit, and a mismatch reads as values::

    layers.0.mlp.down_proj.weight_scale: 0.0123 -> 0.01241 (rel 8.9e-03)

What is compared (:func:`golden_diff`):

- every field except a tensor's ``summary`` exactly (hashes, dtypes, shapes,
  small values, JSON configs): use it only for bytes that are a pure function
  of fixed inputs, never for a float that came out of a matmul or a forward
  pass, whose last bit depends on the machine;
- an ``approx`` section ``{name: [numbers]}`` within the tolerance the
  *obtained* data states under ``tolerance`` (``{"rtol": r, "atol": a}``):
  ``|obtained - golden| <= atol + rtol * |golden|`` elementwise. This is for
  values computed by a forward pass (calibrated activation scales).

A tensor's ``summary`` is for reading only: it is shown in a diff, never compared.

:class:`GoldenStore` implements the outcomes the plugin promises:

- missing golden: fails, telling how to create it;
- ``update=True``: (re)writes the golden atomically and passes, except for a
  golden the store is not allowed to write (see ``may_update``), which is
  compared as usual;
- mismatch: writes ``<name>.obtained`` next to the golden and fails with the
  readable diff.

This module imports torch and numpy only inside the functions that describe
tensors, so the plugin can build a store without importing them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the check package imports this module: no import cycle at run time
    from pytest_exportcheck.checks._api import CheckResult

__all__ = [
    "BUILTIN_GOLDENS",
    "GOLDEN_SUFFIX",
    "OBTAINED_SUFFIX",
    "SMALL_TENSOR",
    "UPDATE_HINT",
    "GoldenStore",
    "dump_golden",
    "golden_diff",
    "safetensors_digest",
    "tensor_digest",
    "tensor_record",
    "tensor_values",
    "tensors_digest",
]

GOLDEN_SUFFIX = ".json"
OBTAINED_SUFFIX = ".obtained"
UPDATE_HINT = (
    "if the change is intended, run `pytest --export-exporters=<exporter> "
    "--export-update-goldens` and review the diff of the golden before committing it"
)
#: Tensors with at most this many elements carry their values in a golden.
SMALL_TENSOR = 32
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*(/[A-Za-z0-9_][A-Za-z0-9_.\-]*)*$")
_MAX_DIFF_LINES = 60
_SHOWN_ELEMENTS = 4

#: Goldens of the built-in module exporters, shipped inside the package
#: (``pytest_exportcheck/_goldens`` is the repo's ``goldens/`` directory).
BUILTIN_GOLDENS = Path(__file__).resolve().parent / "_goldens"


def dump_golden(data: Mapping[str, Any]) -> str:
    """The canonical text of a golden: JSON, sorted keys, 2-space indent, final newline."""
    return json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"


# ----------------------------------------------------------------------------- describing


def _host_bytes(tensor: Any) -> tuple[Any, bytes]:
    import torch

    host = tensor.detach().to("cpu").contiguous()
    return host, host.reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_digest(tensor: Any) -> dict[str, Any]:
    """``{"dtype", "shape", "sha256"}`` of a torch tensor's bytes (C-contiguous, on the host).

    ``dtype`` is torch's name without the ``torch.`` prefix (``"float8_e4m3fn"``).
    The bytes are read through a ``uint8`` view, so FP8 and bf16 hash exactly.
    """
    host, raw = _host_bytes(tensor)
    return {
        "dtype": str(host.dtype).removeprefix("torch."),
        "shape": list(host.shape),
        "sha256": hashlib.sha256(raw).hexdigest(),
    }


def _number(value: float, is_float: bool) -> float | int | str:
    """A JSON number that reads back to the same float32 (shortest repr); NaN/inf as text."""
    if not is_float:
        return int(value)
    if not math.isfinite(value):
        return str(value)
    import numpy as np

    return float(str(np.float32(value)))


def tensor_values(tensor: Any) -> list[float | int | str]:
    """Every element of ``tensor`` as JSON numbers (float32's shortest repr; NaN/inf as text)."""
    import torch

    host = tensor.detach().to("cpu")
    is_float = host.is_floating_point()
    flat = host.reshape(-1)
    flat = flat.to(torch.float32) if is_float else flat.to(torch.int64)
    return [_number(v, is_float) for v in flat.tolist()]


def _summary(host: Any) -> dict[str, Any]:
    """absmax, mean (an exactly rounded sum, so the same on every machine) and NaN/inf count."""
    import torch

    if not (host.is_floating_point() or host.dtype in (torch.int8, torch.uint8, torch.int32)):
        return {}
    values = host.reshape(-1).to(torch.float64)
    finite = values[torch.isfinite(values)].tolist()
    nonfinite = values.numel() - len(finite)
    absmax = max((abs(v) for v in finite), default=0.0)
    mean = math.fsum(finite) / len(finite) if finite else 0.0
    return {
        "absmax": float(f"{absmax:.6g}"),
        "mean": float(f"{mean:.6g}"),
        "nonfinite": nonfinite,
    }


def tensor_record(tensor: Any, small: int = SMALL_TENSOR) -> dict[str, Any]:
    """:func:`tensor_digest` plus ``values`` (at most ``small`` elements) or a ``summary``.

    Values are written as the shortest decimal that reads back to the same
    float32 (FP8 and bf16 are exact in float32); integer tensors as integers.
    The summary's mean is computed with an exactly rounded sum of the float64
    values, so it reads the same everywhere, but it is never compared: the hash
    decides.
    """
    record = tensor_digest(tensor)
    host, _ = _host_bytes(tensor)
    if host.numel() <= small:
        record["values"] = tensor_values(host)
    else:
        summary = _summary(host)
        if summary:
            record["summary"] = summary
    return record


def tensors_digest(
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
) -> dict[str, dict[str, Any]]:
    """name -> :func:`tensor_record` for a mapping (or pairs) of tensors, sorted by name."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    return {name: tensor_record(value) for name, value in sorted(items, key=lambda kv: kv[0])}


def safetensors_digest(directory: Path) -> dict[str, dict[str, Any]]:
    """:func:`tensors_digest` of every tensor in every ``*.safetensors`` file under ``directory``.

    Tensor names are unique across shards in a Hugging Face checkpoint; a name
    seen in two shards raises ``ValueError`` (it would make the golden ambiguous).
    """
    from safetensors import safe_open

    digest: dict[str, dict[str, Any]] = {}
    for shard in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if name in digest:
                    raise ValueError(
                        f"tensor {name!r} appears in more than one shard of {directory}"
                    )
                digest[name] = tensor_record(handle.get_tensor(name))
    return dict(sorted(digest.items()))


# ----------------------------------------------------------------------------- comparing


def _rel(old: float, new: float) -> str:
    if old == new:
        return "rel 0"
    if old == 0:
        return f"abs {abs(new - old):.2e}"
    return f"rel {abs(new - old) / abs(old):.1e}"


def _fmt(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _value_changes(name: str, old: Sequence[Any], new: Sequence[Any]) -> list[str]:
    if len(old) != len(new):
        return [f"{name}: {len(old)} values -> {len(new)} values"]
    changed = [i for i, (a, b) in enumerate(zip(old, new)) if a != b]
    if not changed:
        return []
    if len(old) == 1:
        a, b = old[0], new[0]
        numeric = isinstance(a, (int, float)) and isinstance(b, (int, float))
        return [f"{name}: {a} -> {b}" + (f" ({_rel(float(a), float(b))})" if numeric else "")]
    shown = ", ".join(
        f"[{i}] {old[i]} -> {new[i]}"
        + (
            f" ({_rel(float(old[i]), float(new[i]))})"
            if isinstance(old[i], (int, float)) and isinstance(new[i], (int, float))
            else ""
        )
        for i in changed[:_SHOWN_ELEMENTS]
    )
    more = f", ... ({len(changed)} of {len(old)} elements differ)" if len(changed) > 1 else ""
    return [f"{name}: {shown}{more}"]


def _tensor_changes(name: str, old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    for field in ("dtype", "shape"):
        if old.get(field) != new.get(field):
            return [f"{name}: {field} {_fmt(old.get(field))} -> {_fmt(new.get(field))}"]
    if "values" in old and "values" in new:
        lines = _value_changes(name, old["values"], new["values"])
        if lines or old.get("sha256") == new.get("sha256"):
            return lines
    if old.get("sha256") == new.get("sha256"):
        return []
    before, after = old.get("summary", {}), new.get("summary", {})
    parts = [
        f"{key} {before.get(key)} -> {after.get(key)}"
        for key in ("absmax", "mean", "nonfinite")
        if key in before or key in after
    ]
    kind = f"{new.get('dtype')} {_fmt(new.get('shape'))}"
    return [f"{name} ({kind}): bytes differ" + (f"; {', '.join(parts)}" if parts else "")]


def _tensors_diff(old: Mapping[str, Any], new: Mapping[str, Any], where: str) -> list[str]:
    lines = [f"{where}{n}: in the golden, not obtained" for n in sorted(set(old) - set(new))]
    lines += [f"{where}{n}: obtained, not in the golden" for n in sorted(set(new) - set(old))]
    for name in sorted(set(old) & set(new)):
        lines += _tensor_changes(where + name, old[name], new[name])
    return lines


def _approx_diff(
    old: Mapping[str, Any], new: Mapping[str, Any], tolerance: Mapping[str, Any]
) -> list[str]:
    rtol, atol = float(tolerance.get("rtol", 0.0)), float(tolerance.get("atol", 0.0))
    lines = [f"approx {n}: in the golden, not obtained" for n in sorted(set(old) - set(new))]
    lines += [f"approx {n}: obtained, not in the golden" for n in sorted(set(new) - set(old))]
    for name in sorted(set(old) & set(new)):
        a, b = list(old[name]), list(new[name])
        if len(a) != len(b):
            lines.append(f"approx {name}: {len(a)} values -> {len(b)} values")
            continue
        bad = [
            i
            for i, (x, y) in enumerate(zip(a, b))
            if not (math.isfinite(float(y)) and abs(float(y) - float(x)) <= atol + rtol * abs(x))
        ]
        if bad:
            lines += _value_changes(f"approx {name}", [a[i] for i in bad], [b[i] for i in bad])
            lines[-1] += f" beyond atol={atol:g} + rtol={rtol:g}*|golden|"
    return lines


def _json_diff(old: Any, new: Any, path: str) -> list[str]:
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        lines: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            sub = f"{path}.{key}" if path else str(key)
            if key not in new:
                lines.append(f"{sub}: in the golden, not obtained ({_fmt(old[key])[:80]})")
            elif key not in old:
                lines.append(f"{sub}: obtained, not in the golden ({_fmt(new[key])[:80]})")
            else:
                lines += _json_diff(old[key], new[key], sub)
        return lines
    if old != new:
        return [f"{path}: {_fmt(old)[:120]} -> {_fmt(new)[:120]}"]
    return []


def golden_diff(expected: Mapping[str, Any], obtained: Mapping[str, Any]) -> list[str]:
    """Readable differences between a golden and an obtained result; empty when they match.

    Tensor descriptions (any mapping under a ``tensors`` key, at any depth)
    compare by name, dtype, shape, hash and small values, and show values or
    summaries; ``approx`` compares within ``obtained["tolerance"]``; every other
    field compares exactly, as JSON.
    """
    return _diff(expected, obtained, "", obtained.get("tolerance", {}))


def _diff(old: Any, new: Any, path: str, tolerance: Mapping[str, Any]) -> list[str]:
    if not (isinstance(old, Mapping) and isinstance(new, Mapping)):
        return _json_diff(old, new, path)
    lines: list[str] = []
    for key in sorted(set(old) | set(new), key=str):
        sub = f"{path}.{key}" if path else str(key)
        if key == "tensors" and key in old and key in new:
            lines += _tensors_diff(old[key], new[key], f"{path}: " if path else "")
        elif key == "approx" and key in old and key in new:
            lines += _approx_diff(old[key], new[key], tolerance)
        elif key == "tolerance":
            continue  # the check states it; a golden cannot loosen it
        elif key in old and key in new:
            lines += _diff(old[key], new[key], sub, tolerance)
        elif key in old:
            lines.append(f"{sub}: in the golden, not obtained ({_fmt(old[key])[:80]})")
        else:
            lines.append(f"{sub}: obtained, not in the golden ({_fmt(new[key])[:80]})")
    return lines


# ----------------------------------------------------------------------------- the store


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling and ``os.replace``.

    Safe under xdist: a reader sees the old file or the new one, never a part.
    The file gets the mode a plain ``open`` would give under the process umask.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class GoldenStore:
    """Golden files under ``directory``; ``update=True`` rewrites instead of comparing.

    Args:
        directory: where ``<name>.json`` files live (``goldens/`` of the repo, or
            ``--export-goldens-dir``); updates are written here.
        update: ``--export-update-goldens``: write every compared golden and pass.
        fallbacks: read-only directories consulted, in order, for a golden that
            ``directory`` does not have (the goldens of the built-in exporters
            shipped with the package, :data:`BUILTIN_GOLDENS`), so a third-party
            repo with its own ``goldens/`` still checks the built-ins.
        may_update: ``may_update(owner) -> reason or None``: whether an update may
            write a golden of something provided by ``owner`` (a distribution
            name). A reason keeps the golden as it is: it is compared instead,
            and the reason is part of the result. Default: always allowed.

    ``used`` holds every golden path compared or written through this store.
    """

    def __init__(
        self,
        directory: str | Path,
        update: bool = False,
        fallbacks: Sequence[str | Path] = (),
        may_update: Callable[[str | None], str | None] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.update = update
        self.fallbacks = tuple(Path(f) for f in fallbacks if Path(f) != Path(directory))
        self.may_update = may_update
        self.used: set[str] = set()

    def __repr__(self) -> str:
        return f"GoldenStore({str(self.directory)!r}, update={self.update})"

    def path(self, name: str) -> Path:
        """The golden file of ``name`` (``a/b`` names live in subdirectories)."""
        if not _NAME.match(name) or ".." in name.split("/"):
            raise ValueError(
                f"invalid golden name {name!r}: use letters, digits, '_', '-', '.' and '/' "
                "separators, without '..' or a leading '/'"
            )
        return self.directory / f"{name}{GOLDEN_SUFFIX}"

    def obtained_path(self, name: str) -> Path:
        """Where a mismatching result of ``name`` is written (``<name>.obtained``)."""
        return self.directory / f"{name}{OBTAINED_SUFFIX}"

    def _existing(self, name: str) -> Path:
        """The golden file to compare with: ``directory``'s, else the first fallback's."""
        golden = self.path(name)
        if golden.exists():
            return golden
        for directory in self.fallbacks:
            candidate = directory / golden.relative_to(self.directory)
            if candidate.exists():
                return candidate
        return golden

    def check(self, name: str, data: Mapping[str, Any], owner: str | None = None) -> CheckResult:
        """Compare ``data`` with the golden ``name``; see the module docstring for outcomes.

        ``owner`` is the distribution that provides what the golden describes
        (for ``may_update``).
        """
        from pytest_exportcheck.checks._api import CheckResult

        refused = self.may_update(owner) if self.update and self.may_update else None
        if self.update and refused is None:
            return self._write(name, data)
        golden = self._existing(name)
        self.used.add(str(golden))
        obtained = self.obtained_path(name)
        note = f" (not updated: {refused})" if refused else ""
        if not golden.exists():
            return CheckResult.failed(
                f"golden {golden} is missing{note}; to create it, run `pytest "
                "--export-exporters=<exporter> --export-update-goldens` and commit the file",
                golden=str(golden),
                goldens=[str(golden)],
            )
        expected = json.loads(golden.read_text(encoding="utf-8"))
        lines = golden_diff(expected, data)
        if not lines:
            if obtained.exists():
                obtained.unlink(missing_ok=True)
            return CheckResult.passed(f"matches golden {golden}{note}", goldens=[str(golden)])
        write_text_atomic(obtained, dump_golden(data))
        shown = lines[:_MAX_DIFF_LINES]
        if len(lines) > _MAX_DIFF_LINES:
            shown.append(f"... ({len(lines) - _MAX_DIFF_LINES} more differences)")
        return CheckResult.failed(
            f"result differs from golden {golden} in {len(lines)} place(s){note}; obtained "
            f"written to {obtained}; {UPDATE_HINT}\n" + "\n".join(f"  {line}" for line in shown),
            golden=str(golden),
            obtained=str(obtained),
            goldens=[str(golden)],
            differences=lines[:_MAX_DIFF_LINES],
        )

    def _write(self, name: str, data: Mapping[str, Any]) -> CheckResult:
        from pytest_exportcheck.checks._api import CheckResult

        golden = self.path(name)
        self.used.add(str(golden))
        existed = golden.exists()
        text = dump_golden(data)
        if not existed or golden.read_text(encoding="utf-8") != text:
            write_text_atomic(golden, text)
        self.obtained_path(name).unlink(missing_ok=True)
        return CheckResult.passed(
            f"golden {golden} {'updated' if existed else 'written'}", goldens=[str(golden)]
        )

    def unused(self, used: Iterable[str]) -> list[Path]:
        """Golden files under ``directory`` that are not in ``used`` (paths), sorted."""
        seen = {str(Path(p)) for p in used}
        return sorted(p for p in self.directory.rglob(f"*{GOLDEN_SUFFIX}") if str(p) not in seen)
