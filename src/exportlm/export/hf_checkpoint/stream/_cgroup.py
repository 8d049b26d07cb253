"""The memory limit of the cgroup this process runs in, and what that cgroup already charges.

A process's cgroup is named in ``/proc/self/cgroup`` (cgroup v2: ``0::/path``; v1:
``N:memory:/path`` for the memory controller's hierarchy), relative to the root of the
hierarchy; ``/proc/self/mountinfo`` says where that hierarchy is mounted and which of its
directories the mount shows (its root: ``/`` on a host, the container's own cgroup in a
container without a cgroup namespace). Only inside a cgroup namespace is the process's
cgroup the mount's root; a Slurm job (``/slurm/uid_*/job_*``), a systemd service or scope
and a nested cgroup are directories below it, with limits of their own and of every
ancestor.

:func:`cgroup_headroom` walks from the process's cgroup up to the mount's root and reads,
at every level, the limit (v2 ``memory.max`` and ``memory.high``, v1
``memory.limit_in_bytes``) and what the level charges (v2 ``memory.current``, v1
``memory.usage_in_bytes``: page cache included, since the kernel reclaims it only under
pressure and a streamed export writes gigabytes of it). The headroom of a level is its
limit less its charge; the smallest headroom over every level is what this process may
still allocate. A file that is missing or unreadable, ``max`` and v1's "no limit" (a
page-rounded 2**63) limit nothing.

``proc`` and ``root`` are parameters so tests run on fake trees: the mount points in
``mountinfo`` are read below ``root``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CgroupHeadroom", "cgroup_headroom"]

#: A cgroup v1 "no limit" is a huge page-rounded number; anything above this is none.
NO_LIMIT = 1 << 60
#: (limit files, charge file) per cgroup version.
_FILES = {
    2: (("memory.max", "memory.high"), "memory.current"),
    1: (("memory.limit_in_bytes",), "memory.usage_in_bytes"),
}


@dataclass(frozen=True)
class CgroupHeadroom:
    """The tightest level of the process's cgroups: what it may still allocate, and why."""

    headroom: int  # limit - charged (0 when the cgroup is at or over its limit)
    limit: int  # the limit of that level (bytes)
    charged: int  # what that level charges now (bytes, page cache included)
    file: Path  # the limit file read (below ``root``)

    def describe(self) -> str:
        """One line for the log."""
        return (
            f"cgroup limit {self.limit / 1e9:.2f} GB ({self.file}), {self.charged / 1e9:.2f} GB "
            f"charged: {self.headroom / 1e9:.2f} GB left"
        )


def cgroup_headroom(proc: Path = Path("/proc"), root: Path = Path("/")) -> CgroupHeadroom | None:
    """The tightest limit over the process's memory cgroups (v1 and v2) and their ancestors.

    ``None`` when no level limits memory (or nothing can be read).
    """
    levels = [
        found
        for version, directory, top in _cgroup_directories(proc, root)
        for level in _ancestors(directory, top)
        if (found := _level(version, level)) is not None
    ]
    return min(levels, key=lambda level: level.headroom, default=None)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace")
    except (OSError, ValueError):
        return None


def _number(path: Path) -> int | None:
    """The integer in ``path``; ``None`` for ``max``, v1's no-limit, or an unreadable file."""
    raw = (_read(path) or "").strip()
    if not raw.isdigit() or int(raw) >= NO_LIMIT:
        return None
    return int(raw)


def _level(version: int, directory: Path) -> CgroupHeadroom | None:
    """The tightest limit of one cgroup directory, with what it charges."""
    names, charge_name = _FILES[version]
    limits = [(n, file) for name in names if (n := _number(file := directory / name)) is not None]
    if not limits:
        return None
    limit, file = min(limits)
    charged = _number(directory / charge_name) or 0
    return CgroupHeadroom(max(limit - charged, 0), limit, charged, file)


def _ancestors(directory: Path, top: Path) -> list[Path]:
    """``directory`` and each parent up to ``top`` (the mount point), both included."""
    chain = [directory]
    while chain[-1] != top and top in chain[-1].parents:
        chain.append(chain[-1].parent)
    return chain


def _cgroup_directories(proc: Path, root: Path) -> list[tuple[int, Path, Path]]:
    """``(version, the process's cgroup directory, its mount point)`` for the memory hierarchies."""
    mounts = _mounts(_read(proc / "self" / "mountinfo") or "")
    found = []
    for line in (_read(proc / "self" / "cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            version, key = 2, "cgroup2"
        elif "memory" in controllers.split(","):
            version, key = 1, "memory"
        else:
            continue
        for mount_root, mount_point in mounts.get(key, []):
            directory = _below(path, mount_root, mount_point)
            if directory is not None:
                top = root / mount_point.lstrip("/")
                found.append((version, root / directory.lstrip("/"), top))
                break
    return found


def _below(path: str, mount_root: str, mount_point: str) -> str | None:
    """Where cgroup ``path`` is under a mount of ``mount_root`` at ``mount_point``, if it is."""
    relative = os.path.relpath(path, mount_root) if path.startswith("/") else None
    if relative is None or relative == ".." or relative.startswith("../"):
        return None
    return mount_point if relative == "." else os.path.join(mount_point, relative)


def _mounts(mountinfo: str) -> dict[str, list[tuple[str, str]]]:
    """``{"cgroup2" | "memory": [(mount root, mount point)]}`` from ``/proc/self/mountinfo``.

    A line: ``id parent major:minor root mount-point options [optional...] - fstype
    source super-options``; paths escape spaces as ``\\040``.
    """
    found: dict[str, list[tuple[str, str]]] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        dash = fields.index("-", 6)
        if len(fields) < dash + 4 or len(fields) < 5:
            continue
        fstype, options = fields[dash + 1], fields[dash + 3].split(",")
        key = "cgroup2" if fstype == "cgroup2" else "memory" if "memory" in options else None
        if key is not None and fstype in ("cgroup", "cgroup2"):
            entry = (_unescape(fields[3]), _unescape(fields[4]))
            found.setdefault(key, []).append(entry)
    return found


def _unescape(field: str) -> str:
    return (field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")).replace(
        "\\134", "\\"
    )
