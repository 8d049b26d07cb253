"""The libraries whose versions matter, in one place, nested: standard library only, on the floor.

Three audiences read versions, each a superset of the one before:

* a manifest (:mod:`exportlm.export.manifest`) records :data:`ARTIFACT_LIBRARIES`, and the
  library the target's runtime loads with (``TargetInfo.runtime_library``);
* the conformance plugin keys its artifact cache and failure memo, and prints its run
  header, with :data:`EXPORT_LIBRARIES`: those and the libraries the built-in targets
  export with;
* ``exportlm env`` (a bug report) shows :data:`ENVIRONMENT_LIBRARIES`.

:func:`installed_version` reads a distribution's version once per process.
"""

from __future__ import annotations

from importlib import metadata

__all__ = [
    "ARTIFACT_LIBRARIES",
    "ENVIRONMENT_LIBRARIES",
    "EXPORT_LIBRARIES",
    "installed_version",
]

#: The distributions every artifact depends on, whichever target wrote it.
ARTIFACT_LIBRARIES: tuple[str, ...] = ("exportlm", "torch", "transformers")
#: ... and those the built-in targets export with: what an export run depends on.
EXPORT_LIBRARIES: tuple[str, ...] = (*ARTIFACT_LIBRARIES, "onnx", "onnxruntime", "onnxscript")
#: ... and what a bug report needs besides, in the order ``exportlm env`` shows them.
ENVIRONMENT_LIBRARIES: tuple[str, ...] = (
    *EXPORT_LIBRARIES,
    "safetensors",
    "numpy",
    "tqdm",
    "datasets",
    "pytest",
    "pytest-xdist",
    "hypothesis",
)

#: Versions already read (:func:`installed_version`), by distribution name.
_FOUND: dict[str, str] = {}


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, read once per process when found; ``None``
    when it is not installed.

    Reading a distribution's metadata parses its ``METADATA`` file (about 5 ms each, four
    per manifest, as much CPU as writing 20 MB); the version of an installed library does
    not change under a running process that imported it, so a found version is kept. A
    missing one is looked up again (it may be installed later in a notebook session).
    """
    found = _FOUND.get(distribution)
    if found is None:
        try:
            found = _FOUND[distribution] = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            return None
    return found
