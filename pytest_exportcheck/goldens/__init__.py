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

:class:`GoldenStore` implements the outcomes the plugin promises, each a
:class:`GoldenOutcome` (the golden checks turn it into their result):

- missing golden: fails, telling how to create it;
- ``update=True``: (re)writes the golden atomically and passes, except for a
  golden the store is not allowed to write (see ``may_update``), which is
  compared as usual;
- mismatch: writes ``<name>.obtained`` next to the golden and fails with the
  readable diff.

The package imports torch and numpy only inside the functions that describe
tensors, so the plugin can build a store without importing them. Its modules:
``_records`` (describing tensors), ``_diff`` (comparing), ``_store`` (the files).
"""

from __future__ import annotations

from pathlib import Path

from pytest_exportcheck.goldens._diff import golden_diff
from pytest_exportcheck.goldens._records import (
    SMALL_TENSOR,
    safetensors_digest,
    tensor_digest,
    tensor_record,
    tensor_values,
    tensors_digest,
)
from pytest_exportcheck.goldens._store import (
    GOLDEN_SUFFIX,
    OBTAINED_SUFFIX,
    UPDATE_HINT,
    GoldenOutcome,
    GoldenStore,
    dump_golden,
    write_text_atomic,
)

__all__ = [
    "BUILTIN_GOLDENS",
    "GOLDEN_SUFFIX",
    "OBTAINED_SUFFIX",
    "SMALL_TENSOR",
    "UPDATE_HINT",
    "GoldenOutcome",
    "GoldenStore",
    "dump_golden",
    "golden_diff",
    "safetensors_digest",
    "tensor_digest",
    "tensor_record",
    "tensor_values",
    "tensors_digest",
    "write_text_atomic",
]

#: Goldens of the built-in module exporters, shipped inside the package
#: (``pytest_exportcheck/_goldens`` is the repo's ``goldens/`` directory).
BUILTIN_GOLDENS = Path(__file__).resolve().parent.parent / "_goldens"
