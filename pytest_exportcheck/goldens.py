"""Golden files: small JSON descriptions of exported tensors, compared byte for byte.

A golden is ``<directory>/<name>.json``, written with sorted keys and two-space
indentation so that a diff between two goldens is readable and stable. Tensors
are described, not stored: name -> ``{"dtype", "shape", "sha256"}`` where the
hash covers the raw bytes (FP8 and other dtypes numpy cannot hold are viewed as
``uint8`` first), so a golden is a few kilobytes and still catches a single
flipped bit.

:class:`GoldenStore` implements the three outcomes the plugin promises:

- missing golden: fails, telling to run ``pytest --export-update-goldens``;
- ``update=True``: (re)writes the golden and passes;
- mismatch: writes ``<name>.obtained`` next to the golden and fails with a
  unified diff.

This module imports torch only inside the functions that hash tensors, so the
plugin can build a store without importing torch.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the check package imports this module: no import cycle at run time
    from pytest_exportcheck.checks._api import CheckResult

__all__ = [
    "GOLDEN_SUFFIX",
    "OBTAINED_SUFFIX",
    "UPDATE_HINT",
    "GoldenStore",
    "dump_golden",
    "safetensors_digest",
    "tensor_digest",
    "tensors_digest",
]

GOLDEN_SUFFIX = ".json"
OBTAINED_SUFFIX = ".obtained"
UPDATE_HINT = "run `pytest --export-update-goldens` to (re)write it if the change is intended"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*(/[A-Za-z0-9_][A-Za-z0-9_.\-]*)*$")
_MAX_DIFF_LINES = 200


def dump_golden(data: Mapping[str, Any]) -> str:
    """The canonical text of a golden: JSON, sorted keys, 2-space indent, final newline."""
    return json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"


def tensor_digest(tensor: Any) -> dict[str, Any]:
    """``{"dtype", "shape", "sha256"}`` of a torch tensor's bytes (C-contiguous, on the host).

    ``dtype`` is torch's name without the ``torch.`` prefix (``"float8_e4m3fn"``).
    The bytes are read through a ``uint8`` view, so FP8 and bf16 hash exactly.
    """
    import torch

    host = tensor.detach().to("cpu").contiguous()
    raw = host.reshape(-1).view(torch.uint8).numpy().tobytes()
    return {
        "dtype": str(host.dtype).removeprefix("torch."),
        "shape": list(host.shape),
        "sha256": hashlib.sha256(raw).hexdigest(),
    }


def tensors_digest(
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
) -> dict[str, dict[str, Any]]:
    """name -> :func:`tensor_digest` for a mapping (or pairs) of tensors, sorted by name."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    return {name: tensor_digest(value) for name, value in sorted(items, key=lambda kv: kv[0])}


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
                digest[name] = tensor_digest(handle.get_tensor(name))
    return dict(sorted(digest.items()))


#: Goldens of the built-in module exporters, shipped inside the package
#: (``pytest_exportcheck/_goldens`` is the repo's ``goldens/`` directory).
BUILTIN_GOLDENS = Path(__file__).resolve().parent / "_goldens"


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
    """

    def __init__(
        self, directory: str | Path, update: bool = False, fallbacks: Sequence[str | Path] = ()
    ) -> None:
        self.directory = Path(directory)
        self.update = update
        self.fallbacks = tuple(Path(f) for f in fallbacks if Path(f) != Path(directory))

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

    def check(self, name: str, data: Mapping[str, Any]) -> CheckResult:
        """Compare ``data`` with the golden ``name``; see the module docstring for outcomes."""
        from pytest_exportcheck.checks._api import CheckResult

        golden = self.path(name) if self.update else self._existing(name)
        obtained = self.obtained_path(name)
        text = dump_golden(data)
        if self.update:
            golden.parent.mkdir(parents=True, exist_ok=True)
            existed = golden.exists()
            golden.write_text(text, encoding="utf-8")
            obtained.unlink(missing_ok=True)
            return CheckResult.passed(f"golden {golden} {'updated' if existed else 'written'}")
        if not golden.exists():
            return CheckResult.failed(
                f"golden {golden} is missing; {UPDATE_HINT}", golden=str(golden)
            )
        expected = golden.read_text(encoding="utf-8")
        if expected == text:
            obtained.unlink(missing_ok=True)
            return CheckResult.passed(f"matches golden {golden}")
        obtained.parent.mkdir(parents=True, exist_ok=True)
        obtained.write_text(text, encoding="utf-8")
        diff = _unified_diff(expected, text, str(golden), str(obtained))
        return CheckResult.failed(
            f"result differs from golden {golden}; obtained written to {obtained}; "
            f"{UPDATE_HINT}\n{diff}",
            golden=str(golden),
            obtained=str(obtained),
        )


def _unified_diff(expected: str, obtained: str, expected_name: str, obtained_name: str) -> str:
    lines = list(
        difflib.unified_diff(
            expected.splitlines(keepends=True),
            obtained.splitlines(keepends=True),
            fromfile=expected_name,
            tofile=obtained_name,
        )
    )
    if len(lines) > _MAX_DIFF_LINES:
        hidden = len(lines) - _MAX_DIFF_LINES
        lines = [*lines[:_MAX_DIFF_LINES], f"... ({hidden} more diff lines)\n"]
    return "".join(lines)
