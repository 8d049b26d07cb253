"""Command-line options, their ini twins, and the resolved :class:`Options`.

Every ``--export-*`` option has an ini key of the same name with ``_`` for ``-``
(``--export-targets`` / ``export_targets``); the command line wins. Imports only pytest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pytest_exportcheck.plan._selection import DEVICES, NameSelection, PlanRequest
from pytest_exportcheck.plan._shard import Shard
from pytest_exportcheck.session.options._coverage_options import coverage_options
from pytest_exportcheck.session.options._option_paths import check_kind, check_report_path
from pytest_exportcheck.session.options._option_specs import _SPECS, _Spec
from pytest_exportcheck.session.options._option_values import (
    UPDATE_SCOPES,
    parse_catalogue,
    parse_count,
    parse_devices,
    parse_engines,
    parse_update_scope,
)

__all__ = [
    "DEVICES",
    "UPDATE_SCOPES",
    "Options",
    "add_options",
    "check_report_path",
]


GROUP = "exportcheck"


def add_options(parser: pytest.Parser) -> None:
    """Add the ``exportcheck`` option group and the ini twins: every option of :data:`_SPECS`."""
    group = parser.getgroup(GROUP, "exportcheck: export conformance suite (exportlm)")
    for spec in _SPECS:
        group.addoption(spec.flag, **spec.option())
        ini = spec.ini_key_args()
        if ini is not None:
            parser.addini(**ini)


def _value(config: pytest.Config, spec: _Spec) -> Any:
    """Command line first, then the ini key; ``None`` when neither is set."""
    value = config.getoption(spec.ini)
    if value is not None:
        return value
    ini = config.getini(spec.ini)
    if spec.kind == "bool":
        return bool(ini)
    return ini if ini not in ("", None) else None


def _path(config: pytest.Config, spec: _Spec) -> Path | None:
    """A path option: relative to the invocation dir (command line) or the ini file's dir."""
    cli = config.getoption(spec.ini)
    if cli is not None:
        return (config.invocation_params.dir / str(cli)).resolve()
    ini = config.getini(spec.ini)
    if not ini:
        return None
    base = config.inipath.parent if config.inipath else config.rootpath
    return (base / str(ini)).resolve()


def _paths(config: pytest.Config, spec: _Spec) -> tuple[Path, ...]:
    """A repeatable path option: each relative to the invocation dir, or the ini file's dir."""
    cli = config.getoption(spec.ini)
    if cli:
        values, base = cli, config.invocation_params.dir
    else:
        values = config.getini(spec.ini) or []
        base = config.inipath.parent if config.inipath else config.rootpath
    return tuple((Path(base) / str(v).strip()).resolve() for v in values if str(v).strip())


@dataclass(frozen=True)
class Options:
    """The resolved ``--export-*`` options of one pytest run."""

    targets: NameSelection | None
    exporters: NameSelection | None
    models: NameSelection
    checks: NameSelection
    devices: tuple[str, ...]
    require_device: bool
    xfails_file: Path | None
    update_goldens: str | None
    goldens_dir: Path | None
    report: Path | None
    no_cache: bool
    only: bool
    durations: int = 0
    #: ``--export-engine`` values, ``NAME=PATH`` each (checked again by the 'served' check).
    engines: tuple[str, ...] = ()
    require_engines: bool = False
    #: ``--export-strict``: an unchecked row fails the run.
    strict: bool = False
    #: ``--export-strict-allow`` / ini ``export_strict_allow``: ``(row, reason)`` accepted unchecked.
    strict_allow: tuple[tuple[str, str], ...] = ()
    #: ``--export-lock``: ``check``, ``update`` or ``off``.
    lock: str = "check"
    #: ``--export-shard=K/N``, or ``None`` for the whole suite.
    shard: Shard | None = None
    catalogue: int | None = None
    #: ``--export-report-absolute-paths``: the JSON report keeps this machine's paths.
    report_absolute_paths: bool = False
    #: ``--export-report-html`` / ``--export-report-badge``: the report as a page and a badge.
    report_html: Path | None = None
    report_badge: Path | None = None
    #: ``--export-model`` / ini ``export_models_dirs``: model directories added as families.
    model_dirs: tuple[Path, ...] = ()
    #: ``--export-quantize``: the recipes of the quantized per-model checks (empty: theirs).
    quantize: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        """True when the conformance suite runs (targets or exporters were selected)."""
        return self.targets is not None or self.exporters is not None

    @property
    def target_selection(self) -> NameSelection:
        """Targets to check; unset means none."""
        return self.targets or NameSelection()

    @property
    def exporter_selection(self) -> NameSelection:
        """Exporters to check; unset means all with ``--export-targets=all``, else none."""
        if self.exporters is not None:
            return self.exporters
        return (
            NameSelection(all=True)
            if self.targets is not None and self.targets.all
            else NameSelection()
        )

    def request(self, checks: NameSelection | None = None) -> PlanRequest:
        """The plan request of this selection; every target and exporter while it selects none."""
        everything = NameSelection(all=True)
        return PlanRequest(
            self.target_selection if self.active else everything,
            self.exporter_selection if self.active else everything,
            self.models,
            checks or self.checks,
            self.devices,
        )

    @classmethod
    def from_config(cls, config: pytest.Config) -> Options:
        """Read and validate the options (a bad value is a ``pytest.UsageError``)."""
        specs = {s.ini: s for s in _SPECS}

        def selection(name: str) -> NameSelection | None:
            raw = _value(config, specs[name])
            return None if raw is None else NameSelection.parse(str(raw), specs[name].flag)

        devices = parse_devices(str(_value(config, specs["export_device"]) or "cpu"))
        options = cls(
            targets=selection("export_targets"),
            exporters=selection("export_exporters"),
            models=selection("export_models") or NameSelection(all=True),
            checks=selection("export_checks") or NameSelection(all=True),
            devices=devices,
            require_device=bool(_value(config, specs["export_require_device"])),
            xfails_file=_path(config, specs["export_xfails_file"]),
            update_goldens=parse_update_scope(_value(config, specs["export_update_goldens"])),
            goldens_dir=_path(config, specs["export_goldens_dir"]),
            report=_path(config, specs["export_report"]),
            no_cache=bool(_value(config, specs["export_no_cache"])),
            only=bool(_value(config, specs["export_only"])),
            durations=parse_count(_value(config, specs["export_durations"]), "--export-durations"),
            engines=parse_engines(_value(config, specs["export_engine"])),
            require_engines=bool(_value(config, specs["export_require_engines"])),
            **coverage_options(config),
            catalogue=parse_catalogue(_value(config, specs["exportcheck_catalogue"])),
            report_absolute_paths=bool(_value(config, specs["export_report_absolute_paths"])),
            report_html=_path(config, specs["export_report_html"]),
            report_badge=_path(config, specs["export_report_badge"]),
            model_dirs=_paths(config, specs["export_models_dirs"]),
            quantize=tuple(
                r.strip()
                for r in str(_value(config, specs["export_quantize"]) or "").split(",")
                if r.strip()
            ),
        )
        if options.only and not options.active:
            raise pytest.UsageError(
                "--export-only needs --export-targets or --export-exporters "
                "(e.g. --export-targets=all); otherwise nothing would run"
            )
        check_kind(options.xfails_file, "--export-xfails-file", directory=False)
        check_kind(options.goldens_dir, "--export-goldens-dir", directory=True)
        if not hasattr(config, "workerinput"):  # the controller writes them, at the very end
            for written in (options.report, options.report_html, options.report_badge):
                if written is not None:
                    check_report_path(written)
        return options

    def as_dict(self) -> dict[str, Any]:
        """JSON-compatible view, for the report header, the JSON report and check cases."""

        def path(p: Path | None) -> str | None:
            return None if p is None else str(p)

        return {
            "targets": str(self.target_selection),
            "exporters": str(self.exporter_selection),
            "models": str(self.models),
            "checks": str(self.checks),
            "device": ",".join(self.devices),
            "require_device": self.require_device,
            "xfails_file": path(self.xfails_file),
            "update_goldens": self.update_goldens,
            "goldens_dir": path(self.goldens_dir),
            "report": path(self.report),
            "report_absolute_paths": self.report_absolute_paths,
            "report_html": path(self.report_html),
            "report_badge": path(self.report_badge),
            "no_cache": self.no_cache,
            "only": self.only,
            "durations": self.durations,
            "engines": list(self.engines),
            "require_engines": self.require_engines,
            "strict": self.strict,
            "strict_allow": [list(pair) for pair in self.strict_allow],
            "lock": self.lock,
            "shard": None if self.shard is None else str(self.shard),
            "catalogue": self.catalogue,
            "model_dirs": [str(p) for p in self.model_dirs],
            "quantize": list(self.quantize),
        }
