"""Calibration texts from a directory written by ``datasets``' ``save_to_disk``.

The directory is untrusted input. Before ``datasets`` opens anything, exportlm reads
its JSON files itself (bounded, :func:`exportlm.hfdir.read_json_object`) and
confines every file they name to the directory: a split of ``dataset_dict.json``
or a data file of ``state.json``'s ``_data_files`` must be a relative path that
resolves inside it (links included) to a regular file or folder, so a FIFO, a
device or a file elsewhere is never opened. A ``custom`` format (a Python
transform a saved dataset cannot carry) is refused. Whatever ``datasets`` or
``pyarrow`` then raise on a malformed directory (an unknown feature type, a
garbage Arrow file) becomes a :class:`~exportlm.calibration.CalibrationDataError`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from exportlm.calibration._common import MAX_SAMPLE_BYTES, SOURCES, CalibrationDataError
from exportlm.errors import ExportLMError, MalformedCheckpointError, NotRegularFileError
from exportlm.hfdir import read_json_object

__all__ = ["dataset_texts"]

_DICT_MARKER = "dataset_dict.json"
_STATE = "state.json"
_INFO = "dataset_info.json"
_STRING_DTYPES = ("string", "large_string")
#: ``_format_type`` values a saved dataset may carry (``datasets.formatting``), ``None`` included.
_FORMATS: tuple[str | None, ...] = (None, "python", "numpy", "np", "torch", "pt", "tensorflow")
_FORMATS += ("tf", "jax", "arrow", "pa", "pandas", "pd", "polars", "pl")


def dataset_texts(path: Path, samples: int | None) -> list[str]:
    """The first ``2 * samples`` string values of the text column (all for ``None``)."""
    if not any((path / marker).is_file() for marker in (_DICT_MARKER, _STATE)):
        raise CalibrationDataError(
            f"calibration data {path} is a directory without {_DICT_MARKER} or {_STATE}, "
            f"so not a dataset saved by datasets' save_to_disk; {SOURCES}"
        )
    try:
        import datasets
    except ImportError as err:
        raise CalibrationDataError(
            f"calibration data {path} is a dataset saved with save_to_disk, and reading it "
            "needs the `datasets` package: run `pip install datasets`, or pass the texts "
            "as a text file or a JSON list instead"
        ) from err
    _vet(path)
    try:
        return _read(datasets, path, samples)
    except (ExportLMError, MemoryError):
        raise
    except Exception as err:  # datasets / pyarrow: TypeError, KeyError, ArrowInvalid, ...
        raise CalibrationDataError(
            f"calibration data {path}: datasets cannot read this directory "
            f"({type(err).__name__}: {err}); it is not a dataset written by save_to_disk, "
            "or it is damaged: save it again with Dataset.save_to_disk"
        ) from err


def _read(datasets: Any, path: Path, samples: int | None) -> list[str]:
    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        dataset = dataset[_pick_split(path, list(dataset))]
    column = _pick_column(path, dataset.features)
    count = len(dataset) if samples is None else min(samples * 2, len(dataset))
    # Read twice the samples asked for, so that a few blank rows still leave enough.
    rows = dataset.with_format("arrow")[:count][column]  # Arrow, memory-mapped: nothing copied
    _check_lengths(path, rows)
    return [t for t in rows.to_pylist() if isinstance(t, str)]


def _check_lengths(path: Path, rows: Any) -> None:
    """Refuse a row longer than a text file's line may be, before it becomes a Python string."""
    import pyarrow.compute as pc

    longest = pc.max(pc.binary_length(rows)).as_py() or 0
    if longest > MAX_SAMPLE_BYTES:
        raise CalibrationDataError(
            f"calibration data {path}: a text of {longest} bytes, longer than the "
            f"{MAX_SAMPLE_BYTES} a calibration sample may have (MAX_SAMPLE_BYTES); split the "
            "texts into shorter samples and save the dataset again with save_to_disk"
        )


def _vet(path: Path) -> None:
    """Refuse what ``datasets`` would open outside ``path``, or open blocking."""
    if (path / _STATE).is_file():  # what datasets opens as a Dataset ...
        _vet_dataset(path)
    if (path / _DICT_MARKER).is_file():  # ... or as a DatasetDict: both vetted when both exist
        splits = _json(path / _DICT_MARKER).get("splits")
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise CalibrationDataError(
                f"calibration data {path}: {_DICT_MARKER} has no 'splits' list of names; "
                "save the dataset again with save_to_disk"
            )
        for split in splits:
            _vet_dataset(_inside(path, split, "a split of dataset_dict.json", directory=True))


def _vet_dataset(folder: Path) -> None:
    state = _json(folder / _STATE)
    if (folder / _INFO).exists():
        _json(folder / _INFO)  # bounded and regular before datasets reads it
    files = state.get("_data_files")
    if not isinstance(files, list) or not files:
        raise CalibrationDataError(
            f"calibration data {folder / _STATE}: '_data_files' is not a list of data files; "
            "save the dataset again with save_to_disk"
        )
    for entry in files:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str):
            raise CalibrationDataError(
                f"calibration data {folder / _STATE}: '_data_files' entry {entry!r} names no "
                "file; expected {'filename': 'data-00000-of-00001.arrow'}"
            )
        _inside(folder, name, f"a data file of {_STATE}", directory=False)
    fmt = state.get("_format_type")
    if fmt not in _FORMATS:
        raise CalibrationDataError(
            f"calibration data {folder / _STATE}: format {fmt!r} is not one a saved dataset "
            f"can be read with (a custom format needs a Python transform); expected one of "
            f"{[f for f in _FORMATS if f]} or null: run dataset.reset_format() and save it again with "
            "save_to_disk"
        )


def _inside(root: Path, name: str, role: str, *, directory: bool) -> Path:
    """``root / name`` when it is a relative path resolving inside ``root`` to the right kind."""
    target = root / name
    where = f"calibration data {root}: {role} names {name!r}"
    if os.path.isabs(name) or ".." in Path(name).parts or not name:
        raise CalibrationDataError(
            f"{where}, outside the dataset directory; every file a saved dataset names is "
            "a relative path inside it: save the dataset again with save_to_disk"
        )
    try:
        resolved = target.resolve(strict=True)
        mode = os.stat(resolved).st_mode
    except OSError as err:
        raise CalibrationDataError(f"{where}, which cannot be read: {err}") from err
    if not resolved.is_relative_to(root.resolve()):
        raise CalibrationDataError(
            f"{where}, a link to {resolved} outside the dataset directory; copy the "
            "dataset with its files (cp -rL) instead of linking to them"
        )
    kind_ok = stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode)
    if not kind_ok:
        expected = "a directory" if directory else "a regular file"
        raise CalibrationDataError(
            f"{where}, which is not {expected}; a FIFO, device or socket would block or "
            "never end: save the dataset again with save_to_disk"
        )
    return target


def _json(path: Path) -> dict[str, Any]:
    try:
        return read_json_object(path, what="calibration dataset file")
    except (MalformedCheckpointError, NotRegularFileError) as err:
        raise CalibrationDataError(f"{err} ({SOURCES})") from err
    except OSError as err:
        raise CalibrationDataError(f"calibration data {path}: cannot read it: {err}") from err


def _pick_split(path: Path, splits: list[str]) -> str:
    if "train" in splits:
        return "train"
    if len(splits) == 1:
        return splits[0]
    raise CalibrationDataError(
        f"calibration data {path} is a DatasetDict with splits {', '.join(sorted(splits))} "
        "and none named 'train'; save the split to use with Dataset.save_to_disk"
    )


def _pick_column(path: Path, features: Any) -> str:
    strings = [
        str(name)
        for name, feature in features.items()
        if getattr(feature, "dtype", None) in _STRING_DTYPES
    ]
    if "text" in strings:
        return "text"
    if len(strings) == 1:
        return strings[0]
    described = ", ".join(f"{name} ({feature})" for name, feature in features.items())
    reason = "several string columns" if strings else "no string column"
    raise CalibrationDataError(
        f"calibration data {path} has {reason} and none named 'text': {described}; "
        "rename the column to use to 'text' (dataset.rename_column) and save it again"
    )
