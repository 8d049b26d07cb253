"""Every ``--export-*`` option as data: flag, help, kind, metavar, default, ini key.

:func:`pytest_exportcheck.session.options._options.add_options` registers each, with its ini twin
(``--export-targets`` / ``export_targets``), in one loop over :data:`_SPECS`, and
:class:`~._options.Options` (with :mod:`._coverage_options`) reads them back. No option
is declared anywhere else. Imports nothing but the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["_SPECS", "_Spec"]

#: kind -> the ``addoption`` keywords it implies (besides dest, help, metavar, default).
_ACTIONS: dict[str, dict[str, Any]] = {
    "str": {"action": "store"},
    "path": {"action": "store"},
    "bool": {"action": "store_true"},
    "append": {"action": "append"},
    "optional": {"action": "store", "nargs": "?"},  # a bare flag means ``const``
    "negate": {"action": "store_const"},  # stores ``const`` into its ini twin's option
}
#: kind -> ``(addini type, default)``; a kind absent here has no ini key of its own.
_INI: dict[str, tuple[str, Any]] = {
    "str": ("string", None),
    "path": ("string", ""),
    "bool": ("bool", False),
    "append": ("linelist", []),
    "optional": ("string", ""),
}


@dataclass(frozen=True)
class _Spec:
    flag: str
    help: str
    # "str" | "path" | "bool" | "append" (repeatable; the ini key is a list of lines) |
    # "optional" (a value that may be left out: the bare flag means ``const``) |
    # "negate" (``--no-...``: stores ``const`` into the option of ``ini_key``, no ini key)
    kind: str
    metavar: str | None = None
    default: str = ""
    ini_key: str = ""  # an ini key other than the flag's twin
    const: str | None = None
    ini_help: str = ""  # the ini key's help other than "default of --flag"

    def __post_init__(self) -> None:
        if self.kind not in _ACTIONS:
            raise ValueError(f"option {self.flag}: unknown kind {self.kind!r}")
        if (self.const is None) == (self.kind in ("optional", "negate")):
            raise ValueError(f"option {self.flag}: const goes with kinds optional and negate")

    @property
    def ini(self) -> str:
        return self.ini_key or self.flag.removeprefix("--").replace("-", "_")

    def option(self) -> dict[str, Any]:
        """The keywords of ``addoption``: unset (``None``) unless given, so ini twins apply."""
        words: dict[str, Any] = {**_ACTIONS[self.kind], "default": None, "dest": self.ini}
        if self.const is not None:
            words["const"] = self.const
        if self.metavar is not None:
            words["metavar"] = self.metavar
        return {**words, "help": self.help}

    def ini_key_args(self) -> dict[str, Any] | None:
        """The keywords of ``addini`` for its ini twin; ``None`` for a kind without one."""
        if self.kind not in _INI:
            return None
        kind, default = _INI[self.kind]
        return {
            "name": self.ini,
            "help": self.ini_help or f"default of {self.flag}",
            "type": kind,
            "default": self.default if default is None else default,
        }


_SPECS: tuple[_Spec, ...] = (
    _Spec(
        "--export-targets",
        "export targets to check: 'all' or a,b (activates the suite; "
        "'all' also selects every module exporter)",
        "str",
        "all|a,b",
    ),
    _Spec(
        "--export-exporters",
        "module exporters to check: 'all', 'none' or a,b (activates the suite)",
        "str",
        "all|a,b",
    ),
    _Spec(
        "--export-models",
        "toy model families (rows of the matrix): 'all' or a,b "
        "(default: all, built in and plugin-registered)",
        "str",
        "all|a,b",
        "all",
    ),
    _Spec(
        "--export-model",
        "a local Hugging Face model directory to add as a row of every per-model check "
        "(repeatable; ini export_models_dirs: one per line; see docs/checks.md)",
        "append",
        "PATH",
        ini_key="export_models_dirs",
    ),
    _Spec(
        "--export-quantize",
        "quantization recipe(s) the quantized checks (loadable, roundtrip_quantized, "
        "the module-exporter survey, quantized_generated) use instead of their own "
        "lists: a,b (e.g. fp8 or int4_awq,w8a8); default: each check's own",
        "str",
        "a,b",
    ),
    _Spec(
        "--export-checks",
        "check ids to run: 'all' or a,b (default: all; see docs/checks.md)",
        "str",
        "all|a,b",
        "all",
    ),
    _Spec(
        "--export-device",
        "device(s) the roundtrips run on: cpu, cuda or cpu,cuda (default: cpu)",
        "str",
        "cpu|cuda",
        "cpu",
    ),
    _Spec(
        "--export-require-device", "fail, instead of skip, items whose device is missing", "bool"
    ),
    _Spec(
        "--export-xfails-file",
        "expected failures: a file of node ids, one per line ('# reason' after one "
        "optional), or a JSON object {item-id-pattern: reason}",
        "path",
        "PATH",
    ),
    _Spec(
        "--export-update-goldens",
        "rewrite golden files instead of comparing: 'own' (the default when the flag has no "
        "value) writes only goldens of exporters your project's distribution provides; 'all' "
        "also writes local copies of other distributions' goldens (they then shadow the shipped ones)",
        "optional",
        "own|all",
        const="own",
    ),
    _Spec(
        "--export-goldens-dir",
        "golden files directory (default: goldens/ under rootdir)",
        "path",
        "DIR",
    ),
    _Spec(
        "--export-report",
        "write the conformance matrix and per-item records as JSON",
        "path",
        "PATH.json",
    ),
    _Spec(
        "--export-report-html",
        "write the report as one self-contained HTML page: both matrices, each cell "
        "linking to its items, the engines, the environment",
        "path",
        "PATH.html",
    ),
    _Spec(
        "--export-report-badge",
        "write an SVG badge (passed/total items, coloured by the verdict) for a README",
        "path",
        "PATH.svg",
    ),
    _Spec(
        "--export-report-absolute-paths",
        "keep this machine's absolute paths in the JSON report (default: relative to the "
        "rootdir, home and user name redacted, fit to upload)",
        "bool",
    ),
    _Spec("--export-no-cache", "do not reuse exported artifacts across runs", "bool"),
    _Spec(
        "--export-durations",
        "print the N slowest exportcheck items with their time per phase (build, export, "
        "cache, load, compare) and whether their artifact came from the cache (0: off)",
        "str",
        "N",
        "0",
    ),
    _Spec(
        "--export-engine",
        "the interpreter (or venv) of a serving engine for the 'served' check, NAME=PATH; "
        "repeatable (ini: one per line). EXPORTLM_ENGINE_<NAME> is honoured too",
        "append",
        "NAME=PATH",
    ),
    _Spec(
        "--export-require-engines",
        "fail, instead of skip, 'served' items whose engine has no interpreter (CI gates)",
        "bool",
    ),
    _Spec(
        "--export-only",
        "run only the conformance suite; the repo's own tests are not collected",
        "bool",
    ),
    _Spec(
        "--export-catalogue",
        "the catalogue version the plugin conforms to (ini: exportcheck_catalogue): only "
        "checks and model families of that version run, newer ones are counted "
        "(default: the current version, every item)",
        "str",
        "N",
        ini_key="exportcheck_catalogue",
    ),
    # -- coverage in the verdict (read by _coverage_options) ----------------------------
    _Spec(
        "--export-strict",
        "fail the run when a target or exporter is unchecked (every value check skipped); "
        "default: on when the environment variable CI is set",
        "optional",
        "on|off",
        const="on",
        ini_help="default of --export-strict (on|off)",
    ),
    _Spec(
        "--no-export-strict",
        "same as --export-strict=off",
        "negate",
        ini_key="export_strict",
        const="off",
    ),
    _Spec(
        "--export-lock",
        "coverage lockfile exportcheck.lock in the rootdir: 'check' (default: compare "
        "when it exists), 'update' (rewrite it from this run) or 'off'",
        "str",
        "check|update|off",
    ),
    _Spec(
        "--export-shard",
        "run only shard K of N of the suite, split by (target, model family) groups",
        "str",
        "K/N",
    ),
    _Spec(
        "--export-strict-allow",
        "a target or exporter row --export-strict accepts unchecked (repeatable; ini "
        "export_strict_allow: one 'ROW reason' per line); it is still reported as unchecked",
        "append",
        "ROW",
        ini_help="rows --export-strict accepts unchecked, one 'ROW reason' per line",
    ),
)
