"""The memory limit of the process's own cgroup (exportlm.stream.memory_limit), v1 and v2.

Fake ``/proc`` + ``/sys`` trees cover the layouts (nested Slurm-like cgroups, a container
without a cgroup namespace, one with it, hybrid v1 + v2, unlimited, unreadable); one test
runs the CLI in a real child cgroup where the machine lets this process make one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from exportlm.stream import memory_limit
from tests._stream_models import llama_directory

GB = 10**9
GIB = 2**30  # /proc/meminfo counts kB
V2_MOUNT = "41 31 0:38 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"
V1_MOUNT = "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime shared:9 - cgroup cgroup rw,memory"
OTHER_MOUNTS = [
    "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw",
    "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu",
]


def fake_system(
    tmp_path: Path,
    cgroup: list[str],
    mounts: list[str],
    files: dict[str, str],
    available: int | None = 64 * GIB,
) -> tuple[Path, Path]:
    """``(proc, root)`` of a fake machine: ``files`` are paths below ``root`` with their text."""
    proc, root = tmp_path / "proc", tmp_path / "root"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("".join(line + "\n" for line in cgroup))
    (proc / "self" / "mountinfo").write_text("\n".join([*OTHER_MOUNTS, *mounts]) + "\n")
    if available is not None:
        (proc / "meminfo").write_text(f"MemTotal: 1 kB\nMemAvailable: {available // 1024} kB\n")
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return proc, root


def test_v2_a_nested_cgroup_and_its_ancestors_the_tightest_headroom_wins(tmp_path: Path) -> None:
    # a Slurm step: the job's 1.2 GB limit, 0.2 GB charged, is tighter than the step's
    # (unlimited) and the user's (8 GB); the step is not the mount's root
    base = "sys/fs/cgroup/slurm/uid_1"
    proc, root = fake_system(
        tmp_path,
        ["0::/slurm/uid_1/job_7/step_0"],
        [V2_MOUNT],
        {
            f"{base}/memory.max": str(8 * GB),
            f"{base}/memory.current": str(3 * GB),
            f"{base}/job_7/memory.max": str(1_200_000_000),
            f"{base}/job_7/memory.current": str(200_000_000),
            f"{base}/job_7/step_0/memory.max": "max",
            f"{base}/job_7/step_0/memory.current": str(150_000_000),
        },
    )
    assert memory_limit(proc, root) == 1_000_000_000
    # memory.high counts as a limit too (the kernel throttles and reclaims there)
    (root / base / "job_7/step_0/memory.high").write_text(f"{900_000_000}\n")
    assert memory_limit(proc, root) == 750_000_000


def test_v1_the_memory_hierarchy_of_the_process_is_read_not_its_root(tmp_path: Path) -> None:
    # what this machine runs: v1 memory controller, the process in a child of the root
    base = "sys/fs/cgroup/memory"
    proc, root = fake_system(
        tmp_path,
        ["9:name=systemd:/", "4:memory:/process_api/abc", "1:cpu:/", "0::/"],
        [V1_MOUNT],
        {
            f"{base}/memory.limit_in_bytes": "9223372036854771712",  # v1's "no limit"
            f"{base}/memory.usage_in_bytes": str(40 * GB),
            f"{base}/process_api/abc/memory.limit_in_bytes": str(2 * GB),
            f"{base}/process_api/abc/memory.usage_in_bytes": str(GB // 2),  # page cache included
        },
    )
    assert memory_limit(proc, root) == 1_500_000_000


def test_a_container_without_a_cgroup_namespace_mounts_its_own_cgroup(tmp_path: Path) -> None:
    # the mount shows /docker/abc at /sys/fs/cgroup; the process sits in /docker/abc/app
    mount = "41 31 0:38 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw"
    proc, root = fake_system(
        tmp_path,
        ["0::/docker/abc/app"],
        [mount],
        {
            "sys/fs/cgroup/memory.max": str(4 * GB),
            "sys/fs/cgroup/memory.current": str(GB),
            "sys/fs/cgroup/app/memory.max": str(2 * GB),
            "sys/fs/cgroup/app/memory.current": str(GB // 2),
        },
    )
    assert memory_limit(proc, root) == 1_500_000_000


def test_in_a_cgroup_namespace_the_process_cgroup_is_the_mount_root(tmp_path: Path) -> None:
    proc, root = fake_system(
        tmp_path,
        ["0::/"],
        [V2_MOUNT],
        {"sys/fs/cgroup/memory.max": str(GB), "sys/fs/cgroup/memory.current": str(GB // 4)},
    )
    assert memory_limit(proc, root) == 750_000_000


def test_hybrid_v1_and_v2_the_smaller_headroom_wins(tmp_path: Path) -> None:
    proc, root = fake_system(
        tmp_path,
        ["4:memory:/job", "0::/job"],
        [V1_MOUNT, V2_MOUNT.replace("/sys/fs/cgroup ", "/sys/fs/cgroup/unified ")],
        {
            "sys/fs/cgroup/memory/job/memory.limit_in_bytes": str(3 * GB),
            "sys/fs/cgroup/unified/job/memory.max": str(2 * GB),
        },
    )
    assert memory_limit(proc, root) == 2 * GB  # nothing charged where no file says so


def test_no_cgroup_limit_is_the_available_memory(tmp_path: Path) -> None:
    files = {
        "sys/fs/cgroup/memory.max": "max",
        "sys/fs/cgroup/job/memory.max": "max",
        "sys/fs/cgroup/job/memory.current": str(GB),
    }
    proc, root = fake_system(tmp_path, ["0::/job"], [V2_MOUNT], files, available=5 * GIB)
    assert memory_limit(proc, root) == 5 * GIB


def test_the_available_memory_caps_a_larger_cgroup_limit(tmp_path: Path) -> None:
    files = {"sys/fs/cgroup/job/memory.max": str(100 * GB)}
    proc, root = fake_system(tmp_path, ["0::/job"], [V2_MOUNT], files, available=3 * GIB)
    assert memory_limit(proc, root) == 3 * GIB


def test_unreadable_files_limit_nothing_and_the_readable_levels_still_count(
    tmp_path: Path,
) -> None:
    proc, root = fake_system(
        tmp_path,
        ["0::/a/b"],
        [V2_MOUNT],
        {"sys/fs/cgroup/a/memory.max": str(3 * GB), "sys/fs/cgroup/a/b/memory.current": "x"},
    )
    (root / "sys/fs/cgroup/a/b/memory.max").mkdir()  # reading it raises IsADirectoryError
    (root / "sys/fs/cgroup/a/memory.current").write_text("garbage\n")
    assert memory_limit(proc, root) == 3 * GB
    (proc / "self" / "cgroup").unlink()  # no /proc/self/cgroup: the available memory
    assert memory_limit(proc, root) == 64 * GIB
    (proc / "meminfo").unlink()
    assert memory_limit(proc, root) is None


def test_a_cgroup_over_its_limit_leaves_a_budget_of_one_byte(tmp_path: Path) -> None:
    files = {
        "sys/fs/cgroup/job/memory.max": str(GB),
        "sys/fs/cgroup/job/memory.current": str(2 * GB),
    }
    proc, root = fake_system(tmp_path, ["0::/job"], [V2_MOUNT], files)
    assert memory_limit(proc, root) == 1


# ---------------------------------------------------------------- a real child cgroup


def _own_memory_cgroup() -> tuple[Path, str]:
    """(the directory of this process's memory cgroup, the file that limits a child)."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = [line.split(":", 2)[2] for line in lines if "memory" in line.split(":")[1].split(",")]
    if v1 and Path("/sys/fs/cgroup/memory").is_dir():
        return Path("/sys/fs/cgroup/memory") / v1[0].lstrip("/"), "memory.limit_in_bytes"
    controllers = Path("/sys/fs/cgroup/cgroup.controllers")
    if not controllers.is_file() or "memory" not in controllers.read_text().split():
        pytest.skip("no cgroup v1 memory hierarchy, and cgroup v2 has no memory controller")
    v2 = [line.split(":", 2)[2] for line in lines if line.startswith("0::")]
    parent = Path("/sys/fs/cgroup") / (v2[0].lstrip("/") if v2 else "")
    try:
        (parent / "cgroup.subtree_control").write_text("+memory\n")
    except OSError as err:
        pytest.skip(f"cannot enable the memory controller below {parent}: {err}")
    return parent, "memory.max"


@pytest.fixture
def child_cgroup() -> Iterator[tuple[Path, str]]:
    """A fresh child of this process's memory cgroup, removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("making a cgroup needs root")
    parent, limit_file = _own_memory_cgroup()
    child = parent / f"exportlm-test-{uuid.uuid4().hex[:8]}"
    try:
        child.mkdir()
    except OSError as err:
        pytest.skip(f"cannot make a child cgroup in {parent}: {err}")
    try:
        yield child, limit_file
    finally:
        child.rmdir()  # empty again: the CLI that ran in it has exited


def test_the_cli_finds_the_limit_of_the_child_cgroup_it_runs_in(
    tmp_path: Path, child_cgroup: tuple[Path, str]
) -> None:
    child, limit_file = child_cgroup
    (child / limit_file).write_text(f"{3 * GB}\n")
    limit = int((child / limit_file).read_text())  # page-rounded by the kernel
    src = llama_directory(tmp_path, tied=False, layers=1)
    out = tmp_path / "out"
    cli = [sys.executable, "-m", "exportlm", "-v", "export", "--target", "hf_checkpoint"]
    cli += ["--model", str(src), "--out", str(out), "--quantize", "fp8", "--stream"]
    # the wrapper shell moves itself into the cgroup, then becomes the CLI
    wrapper = f'echo $$ > "{child}/cgroup.procs" && exec "$@"'
    run = subprocess.run(
        ["sh", "-c", wrapper, "sh", *cli],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    expected = f"memory budget: cgroup limit {limit / 1e9:.2f} GB ({child / limit_file})"
    assert expected in run.stderr, run.stderr[-3000:]
    assert (out / "exportlm-manifest.json").is_file()
