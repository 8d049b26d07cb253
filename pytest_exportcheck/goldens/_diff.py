"""Comparing a golden with an obtained result: readable differences, field by field.

Internal to :mod:`pytest_exportcheck.goldens` (see its docstring for what is
compared exactly and what within a tolerance).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["golden_diff"]

_SHOWN_ELEMENTS = 4


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
