"""The state of one exportcheck run; every hook in ``plugin.py`` hands off to it.

Created in ``pytest_configure`` only when the suite is active, so everything here
may import exportlm (and through it torch). Runs in every process: the xdist
controller uses it for the header, the warnings about unmatched expected
failures, the matrix and the JSON report; workers (and a run without xdist) use
it to create and run the items.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from collections.abc import Iterator, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest

import pytest_exportcheck
from pytest_exportcheck import HYPOTHESIS_PROFILE, ExportCheckWarning
from pytest_exportcheck._cache import ArtifactCache, library_versions
from pytest_exportcheck._collect import (
    COLLECTOR_NAME,
    PLUGIN_LOADS,
    CheckFailed,
    ExportCheckCollector,
    ExportCheckItem,
    ExporterPlan,
    ItemSpec,
    Plan,
    TargetPlan,
    plan,
)
from pytest_exportcheck._discovery import Discovery, PluginFailure, discover
from pytest_exportcheck._options import DEVICES, Options, Selection
from pytest_exportcheck._report import RESULT_PROPERTY, ReportBuilder, jsonable, write_json_atomic
from pytest_exportcheck._xfails import XfailBook, load_xfails_file
from pytest_exportcheck.checks._api import CHECKS, CheckResult, CheckSpec, ExporterCase, TargetCase

__all__ = ["ExportCheckSession", "build_toy_model"]

logger = logging.getLogger(__name__)

#: Seed of every toy model the suite builds.
SEED = 0


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


class ExportCheckSession:
    """Options, discovery, planning, running and reporting of one pytest run."""

    def __init__(self, config: pytest.Config, options: Options) -> None:
        self.config = config
        self.options = options
        self.report = ReportBuilder()
        self.xfails = XfailBook()
        self._accepts: dict[tuple[str, str], str | None] = {}
        self._plan: Plan | None = None

    # -- configure ----------------------------------------------------------
    def start(self) -> None:
        """Discover plugins, validate the selection and the xfails; register the profile."""
        self._plan = self._resolve_plan()
        self._collect_xfails()
        _register_hypothesis_profile()
        if _is_worker(self.config):
            _share_cpus_between_workers(self.config)
        else:
            self._warn_unmatched_xfails()

    @cached_property
    def discovery(self) -> Discovery:
        """Every registry, loaded once."""
        import pytest_exportcheck.checks  # noqa: F401 - registers the check catalogue

        return discover()

    def _failures(self, kind: str) -> dict[str, list[PluginFailure]]:
        out: dict[str, list[PluginFailure]] = {}
        for failure in self.discovery.failures:
            if failure.kind == kind:
                out.setdefault(failure.name, []).append(failure)
        return out

    def _resolve_plan(self, *, everything: bool = False) -> Plan:
        """The selected (or, with ``everything``, all possible) targets, exporters, models."""
        d, o = self.discovery, self.options

        def pick(selection: Selection, available: list[str], what: str, option: str) -> list[str]:
            chosen = Selection(all=True) if everything else selection
            return chosen.resolve(available, what=what, option=option)

        failed = {kind: self._failures(kind) for kind in _KINDS}
        targets = pick(
            o.target_selection, [*d.targets, *failed["target"]], "export target", "--export-targets"
        )
        exporters = pick(
            o.exporter_selection,
            [*d.exporters, *failed["module exporter"]],
            "module exporter",
            "--export-exporters",
        )
        models = pick(
            o.models, [*d.models, *failed["model family"]], "model family", "--export-models"
        )
        check_ids = pick(o.checks, [*CHECKS, PLUGIN_LOADS], "check", "--export-checks")
        return Plan(
            checks=tuple(CHECKS[c] for c in CHECKS if c in check_ids),
            targets=tuple(self._target_plan(t, failed) for t in targets),
            exporters=tuple(
                ExporterPlan(
                    e, _failure_text(failed["module exporter"].get(e, [])), loaded=e in d.exporters
                )
                for e in exporters
            ),
            extra_failures=(
                self._extra_failures(targets, models, failed, everything)
                if PLUGIN_LOADS in check_ids
                else {}
            ),
            models=tuple(m for m in models if m in d.models),
            devices=DEVICES if everything else o.devices,
        )

    def _extra_failures(
        self,
        targets: list[str],
        models: list[str],
        failed: Mapping[str, Mapping[str, list[PluginFailure]]],
        everything: bool,
    ) -> dict[str, str]:
        """Failing plugin_loads of selected model families and of runtimes no target uses."""
        used = {self.discovery.targets[t].runtime for t in targets if t in self.discovery.targets}
        extra = {
            f"model:{m}": _failure_text(failed["model family"][m])
            for m in models
            if m in failed["model family"]
        }
        if everything or self.options.target_selection.all:
            extra |= {
                f"runtime:{r}": _failure_text(fs)
                for r, fs in failed["runtime"].items()
                if r not in used
            }
        return {k: v for k, v in extra.items() if v is not None}

    def _target_plan(
        self, name: str, failed: Mapping[str, Mapping[str, list[PluginFailure]]]
    ) -> TargetPlan:
        if name not in self.discovery.targets:
            return TargetPlan(name, failure=_failure_text(failed["target"][name]), loaded=False)
        info = self.discovery.targets[name]
        problems = [*failed["target"].get(name, []), *failed["runtime"].get(info.runtime, [])]
        rows = tuple((row.variant, row.export_kwargs) for row in self.discovery.rows(name))
        return TargetPlan(name, rows, info.capabilities, failure=_failure_text(problems))

    def _collect_xfails(self) -> None:
        for name, info in self.discovery.targets.items():
            self.xfails.add(info.expected_failures, source=f"TargetInfo of {name!r}", scope=name)
        for name, exporter in self.discovery.exporters.items():
            declared = getattr(exporter, "expected_failures", None) or {}
            if not isinstance(declared, Mapping):
                raise pytest.UsageError(
                    f"module exporter {name!r}: expected_failures must be a mapping "
                    f"{{check id or item id pattern: reason}}, got {type(declared).__name__}"
                )
            self.xfails.add(declared, source=f"module exporter {name!r}", scope=name)
        if self.options.xfails_file is not None:
            self.xfails.add(
                load_xfails_file(self.options.xfails_file),
                source=str(self.options.xfails_file),
                scope=None,
            )

    def _warn_unmatched_xfails(self) -> None:
        universe = [(s.name, s.check, s.column) for s in plan(self._resolve_plan(everything=True))]
        for rule in self.xfails.unmatched(universe):
            warning = ExportCheckWarning(
                f"expected failure {rule.pattern!r} ({rule.source}) matches no exportcheck "
                "item; fix the check id or item id pattern, or remove the entry"
            )
            try:
                self.config.issue_config_time_warning(warning, stacklevel=2)
            except ExportCheckWarning as err:  # -W error::...ExportCheckWarning
                raise pytest.UsageError(str(err)) from err

    # -- header -------------------------------------------------------------
    def report_header(self) -> list[str]:
        """Options, library versions, CUDA and every discovered plugin, for the header."""
        options = " ".join(f"{k}={v}" for k, v in self.environment()["options"].items())
        versions = ", ".join(f"{n} {v or '-'}" for n, v in library_versions())
        lines = [f"exportcheck: {options}", f"exportcheck versions: {versions}; {self._cuda()}"]
        by_kind: dict[str, dict[str, list[str]]] = {}
        for record in self.discovery.plugins:
            by_kind.setdefault(record.kind, {}).setdefault(record.provider, []).append(record.name)
        for kind, providers in by_kind.items():
            listed = "; ".join(f"{p}: {', '.join(ns)}" for p, ns in sorted(providers.items()))
            lines.append(f"exportcheck {_PLURAL.get(kind, kind)}: {listed}")
        for failure in self.discovery.failures:
            what = "claims a taken name" if failure.conflict else "FAILED to load"
            lines.append(
                f"exportcheck {failure.kind} {failure.name!r} from "
                f"{failure.distribution} {what}: see plugin_loads"
            )
        return lines

    def environment(self) -> dict[str, Any]:
        """Header data shared by the terminal header and the JSON report."""
        return {
            "options": {**self.options.as_dict(), "goldens_dir": str(self.goldens_dir)},
            "environment": {
                **{n: v for n, v in library_versions()},
                "pytest_exportcheck": pytest_exportcheck.__version__,
                "cuda": self._cuda(),
            },
            "plugins": [
                {"kind": r.kind, "name": r.name, "provider": r.provider}
                for r in self.discovery.plugins
            ],
            "plugin_failures": [
                {
                    "kind": f.kind,
                    "name": f.name,
                    "distribution": f.distribution,
                    "message": f.message,
                }
                for f in self.discovery.failures
            ],
        }

    @staticmethod
    def _cuda() -> str:
        import torch

        if not torch.cuda.is_available():
            return "CUDA not available"
        return f"CUDA available ({torch.cuda.device_count()}x {torch.cuda.get_device_name(0)})"

    # -- collection ---------------------------------------------------------
    def ignore_collect(self, path: Path) -> bool | None:
        """With ``--export-only``, nothing of the repo is collected (explicit file args aside)."""
        return True if self.options.only else None

    def modify_items(self, session: pytest.Session, items: list[pytest.Item]) -> None:
        """Append the planned items (with their skip / xfail marks); deselect the rest with --export-only."""
        if self._plan is None:  # pragma: no cover - start() runs in pytest_configure
            raise RuntimeError("exportcheck: modify_items before start")
        collector = ExportCheckCollector.from_parent(
            session, name=COLLECTOR_NAME, nodeid=COLLECTOR_NAME
        )
        new = [self._item(collector, spec) for spec in plan(self._plan)]
        # Count them in "collected N items" like any collected node.
        session.ihook.pytest_collectreport(
            report=pytest.CollectReport(collector.nodeid, "passed", None, list(new))
        )
        if self.options.only and items:
            session.config.hook.pytest_deselected(items=list(items))
            items[:] = []
        items.extend(new)

    def _item(self, collector: ExportCheckCollector, spec: ItemSpec) -> ExportCheckItem:
        check = CHECKS.get(spec.check)
        item: ExportCheckItem = ExportCheckItem.from_parent(
            collector,
            name=spec.name,
            spec=spec,
            runner=self.run_item,
            check_fn=check.fn if check is not None else None,
        )
        if spec.skip:
            item.add_marker(pytest.mark.skip(reason=spec.skip))
        rules = self.xfails.match(spec.name, spec.check, spec.column)
        if rules:
            reason = "; ".join(f"{r.reason} [{r.source}]" for r in rules)
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
        return item

    # -- running ------------------------------------------------------------
    def run_item(self, item: ExportCheckItem) -> None:
        """Run one item: check its device, build its case, call its check, record the result."""
        spec = item.spec
        check = CHECKS.get(spec.check)
        if spec.failure is not None:  # a plugin_loads item of a plugin that failed to load
            result = CheckResult.failed(spec.failure)
        elif check is None:  # plugin_loads without a catalogue function: discovery said fine
            result = CheckResult.passed(f"{spec.column} loaded")
        else:
            self._require_device(spec.device)
            case = self._case(item, check)
            with _hypothesis_profile():
                result = check.fn(case)
            if not isinstance(result, CheckResult):
                raise TypeError(
                    f"check {spec.check!r} returned {type(result).__name__}; "
                    "a check must return a CheckResult"
                )
        item.user_properties.append(
            (
                RESULT_PROPERTY,
                {
                    "status": result.status,
                    "message": result.message,
                    "details": jsonable(dict(result.details)),
                },
            )
        )
        if result.status == "skip":
            pytest.skip(result.message or f"check {spec.check!r} skipped without a reason")
        if result.status == "fail":
            raise CheckFailed(result)

    def _require_device(self, device: str | None) -> None:
        if device != "cuda":
            return
        import torch

        if torch.cuda.is_available():
            return
        reason = "CUDA is not available on this machine (torch.cuda.is_available() is False)"
        if self.options.require_device:
            pytest.fail(f"{reason}, and --export-require-device is set", pytrace=False)
        pytest.skip(reason)

    def _case(self, item: ExportCheckItem, check: CheckSpec) -> TargetCase | ExporterCase:
        spec = item.spec
        common: dict[str, Any] = {
            "workdir": self._workdir(spec.name),
            "seed": SEED,
            "goldens": self.goldens,
            "options": {**self.options.as_dict(), "expected_failure": _xfail_reason(item)},
        }
        if check.scope == "exporter":
            if spec.exporter is None:  # pragma: no cover - plan() sets it
                raise RuntimeError(f"exporter item {spec.name} has no exporter")
            return ExporterCase(
                name=spec.exporter, device=spec.device or "cpu", model_name=spec.model, **common
            )
        if spec.target is None:  # pragma: no cover - plan() sets it
            raise RuntimeError(f"target item {spec.name} has no target")
        if spec.model is not None:
            self._require_accepted(spec.target, spec.model)
        return TargetCase(
            target=spec.target,
            variant=spec.variant,
            export_kwargs=dict(spec.export_kwargs),
            model_name=spec.model,
            device=spec.device or "cpu",
            export=functools.partial(self._export, spec),
            export_instance=functools.partial(self._export, spec),
            **common,
        )

    def _require_accepted(self, target: str, model: str) -> None:
        accepts = self.discovery.targets[target].accepts
        if accepts is None:
            return
        if (target, model) not in self._accepts:
            self._accepts[(target, model)] = accepts(build_toy_model(model, SEED))
        reason = self._accepts[(target, model)]
        if reason:
            pytest.skip(f"target {target!r} does not accept model {model!r}: {reason}")

    def _export(self, spec: ItemSpec, model: Any, **extra: Any) -> Path:
        """``TargetCase.export`` / ``export_instance``: the cached artifact for this target row.

        ``model`` is a toy family name or a model a check built itself.
        """
        if spec.target is None:  # pragma: no cover
            raise RuntimeError(f"item {spec.name} has no target to export with")
        info = self.discovery.targets[spec.target]
        return self.cache.export(
            spec.target,
            {**spec.export_kwargs, **extra},
            model,
            seed=SEED,
            device=spec.device or "cpu",
            suffix=info.suffix,
            directory=info.artifact == "directory",
        )

    @cached_property
    def cache(self) -> ArtifactCache:
        """Cross-run artifact cache (pytest cache dir) unless --export-no-cache or no cacheprovider."""
        root: Path | None = None
        cache = getattr(self.config, "cache", None)
        if cache is not None and not self.options.no_cache:
            root = cache.mkdir("exportcheck") / "artifacts"
            root.mkdir(parents=True, exist_ok=True)
        return ArtifactCache(
            self._tmp_factory().mktemp("exportcheck-artifacts"), root, build_toy_model
        )

    @cached_property
    def goldens_dir(self) -> Path:
        """--export-goldens-dir, else ``goldens/`` under rootdir.

        Goldens missing there are read from the package's own (built-in exporters);
        ``--export-update-goldens`` writes only here, never into the installed package.
        """
        if self.options.goldens_dir is not None:
            return self.options.goldens_dir
        return self.config.rootpath / "goldens"

    @cached_property
    def goldens(self) -> Any:
        """The golden store handed to every case."""
        from pytest_exportcheck.goldens import BUILTIN_GOLDENS, GoldenStore

        return GoldenStore(
            self.goldens_dir,
            update=self.options.update_goldens is not None,
            fallbacks=(BUILTIN_GOLDENS,),
            may_update=self._may_update_golden,
        )

    @cached_property
    def own_distribution(self) -> str | None:
        """``[project].name`` of the ``pyproject.toml`` at rootdir: the project under test."""
        return read_project_name(self.config.rootpath)

    def _may_update_golden(self, owner: str | None) -> str | None:
        """Why ``--export-update-goldens`` must not write a golden of ``owner``'s, or ``None``."""
        if self.options.update_goldens == "all" or owner is None:
            return None
        own = self.own_distribution
        if own is not None and _normalize(own) == _normalize(owner):
            return None
        project = f"this project ({own})" if own else "this project (no [project] name)"
        return (
            f"it describes an exporter that {owner} provides, not {project}; a local copy would "
            f"shadow the golden {owner} ships and hide its regressions. Pass "
            "--export-update-goldens=all to write one anyway"
        )

    def _tmp_factory(self) -> pytest.TempPathFactory:
        # pytest keeps its session TempPathFactory on the config (the tmp_path_factory
        # fixture returns the same object); using it keeps --basetemp and retention.
        factory: pytest.TempPathFactory = self.config._tmp_path_factory  # type: ignore[attr-defined]
        return factory

    def _workdir(self, name: str) -> Path:
        return self._tmp_factory().mktemp(re.sub(r"[\W]", "_", name)[:40], numbered=True)

    # -- reporting ----------------------------------------------------------
    def add_report(self, report: pytest.TestReport) -> None:
        """Fold a test report into the matrix (controller / single process only)."""
        if not _is_worker(self.config):
            self.report.add(report)

    def terminal_summary(self, terminal: Any) -> None:
        """Write the matrix section of the terminal summary."""
        if _is_worker(self.config) or self.config.option.collectonly:
            return
        terminal.write_sep("=", "exportcheck conformance matrix")
        width = self.config.get_terminal_writer().fullwidth
        for line in self.report.summary_lines(width):
            terminal.write_line(line)
        if self.options.report is not None:
            terminal.write_line(f"JSON report: {self.options.report}")
        unused = self.unused_goldens()
        if unused:
            terminal.write_line(
                f"exportcheck: {len(unused)} golden file(s) under {self.goldens_dir} were used "
                "by no item of this full run (stale? delete them, or check the case list):",
                yellow=True,
            )
            for path in unused:
                terminal.write_line(f"  {path}")

    def unused_goldens(self) -> list[Path]:
        """Golden files no item compared or wrote, after a run of every golden item.

        Empty unless every golden item ran (every exporter and every golden
        check selected, nothing deselected), so a partial run never calls a
        golden unused.
        """
        if not self.options.exporter_selection.all or self._plan is None:
            return []
        golden_ids = {c for c in CHECKS if c.startswith("golden_")}
        if not golden_ids <= {c.id for c in self._plan.checks}:
            return []
        expected = {(c, e.name) for c in golden_ids for e in self._plan.exporters}
        records = list(self.report.records.values())
        ran = {(r.check, r.column) for r in records if r.check in golden_ids and r.outcome}
        if not expected or not expected <= ran:
            return []
        used = {g for r in records for g in r.details.get("goldens", [])}
        return [p for p in self.goldens.unused(used) if p.exists()]

    def finish(self) -> None:
        """Write the JSON report and call ``pytest_exportcheck_report`` (controller only)."""
        if _is_worker(self.config):
            return
        data = self.report.to_json(**self.environment())
        if self.options.report is not None:
            write_json_atomic(self.options.report, data)
        self.config.hook.pytest_exportcheck_report(config=self.config, report=data)


_KINDS = ("target", "runtime", "module exporter", "model family")
_PLURAL = {
    "target": "targets",
    "runtime": "runtimes",
    "module exporter": "module exporters",
    "model family": "model families",
}


def _xfail_reason(item: pytest.Item) -> str | None:
    """The reason of the item's expected-failure mark, if it has one."""
    marker = item.get_closest_marker("xfail")
    return None if marker is None else str(marker.kwargs.get("reason", "expected failure"))


def read_project_name(root: Path) -> str | None:
    """``[project].name`` of ``root/pyproject.toml``, or ``None`` (absent or unreadable)."""
    try:
        import tomllib
    except ImportError:  # pragma: no cover - Python 3.10 has no tomllib: no name known
        return None
    try:
        data = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    name = data.get("project", {}).get("name")
    return str(name) if name else None


def _normalize(name: str) -> str:
    """A distribution name as PEP 503 compares it (``Acme_Plugin`` == ``acme-plugin``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _failure_text(failures: list[PluginFailure]) -> str | None:
    """The messages of ``failures``, one per line; ``None`` when there are none."""
    return "\n".join(f.message for f in failures) or None


def build_toy_model(name: str, seed: int) -> Any:
    """A toy model family from ``exportlm.models``, in eval mode."""
    from exportlm.models import build_model

    return build_model(name, seed=seed)


#: Environment variables with which a user fixes the thread count; they win over the share.
_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _share_cpus_between_workers(config: pytest.Config) -> None:
    """Give each xdist worker its share of the CPUs for torch's intra-op thread pool.

    torch sizes its pool to every core of the machine in every process, so with
    ``-n auto`` N workers run N x cores spinning OpenMP threads on the cores:
    measured on 2 cores, quantizing and exporting the toy models got 10-20x slower
    than with one thread per worker. A thread count the user fixed through
    ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` is kept.
    """
    if any(os.environ.get(name) for name in _THREAD_ENV):
        return
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1) or 1)
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    share = max(1, cpus // workers)
    import torch

    if share < torch.get_num_threads():
        logger.info(
            "exportcheck worker: torch threads %d -> %d (%d workers)",
            torch.get_num_threads(),
            share,
            workers,
        )
        torch.set_num_threads(share)


def _register_hypothesis_profile() -> None:
    """Register ``exportcheck-dev`` and ``exportcheck-ci`` (:data:`HYPOTHESIS_PROFILE`).

    Both: ``deadline=None`` (exports take seconds), a fixed ``max_examples``, the
    ``too_slow`` / ``data_too_large`` health checks off, ``print_blob`` and
    ``database=None``, so a conformance run never writes a ``.hypothesis/``
    directory into the user's repository. The CI profile is also derandomized:
    every CI run draws the same examples.
    """
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # pragma: no cover - hypothesis is a test dependency
        return
    common: dict[str, Any] = {
        "deadline": None,
        "max_examples": 10,
        "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
        "print_blob": True,
        "database": None,
    }
    settings.register_profile(HYPOTHESIS_PROFILE["dev"], **common)
    settings.register_profile(HYPOTHESIS_PROFILE["ci"], derandomize=True, **common)


def _in_ci() -> bool:
    """Whether the ``CI`` environment variable is set (to anything but ``""``, ``0``, ``false``, ``no``)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@contextlib.contextmanager
def _hypothesis_profile() -> Iterator[None]:
    """Run under an exportcheck profile unless the user loaded one (--hypothesis-profile).

    ``exportcheck-ci`` when the ``CI`` environment variable is set (or Hypothesis
    loaded its own ``ci`` profile, which it does on CI), else ``exportcheck-dev``.
    A ``--hypothesis-seed`` wins over CI's derandomization (Hypothesis would
    ignore the seed of a derandomized run), so that seed picks the examples under
    the dev profile. A profile the user chose stays as it is.

    Whenever the active settings have no database, Hypothesis' storage (its
    cache of source constants, written whatever the database) goes to a
    directory under the system's temporary directory instead of ``.hypothesis/``
    in the current directory, unless ``HYPOTHESIS_STORAGE_DIRECTORY`` is set.
    """
    try:
        import hypothesis.configuration
        import hypothesis.core
        from hypothesis import settings
        from hypothesis.errors import InvalidArgument
    except ImportError:  # pragma: no cover
        yield
        return
    before = settings.get_current_profile_name()
    ours = before in ("default", "ci")
    if ours:
        seeded = getattr(hypothesis.core, "global_force_seed", None) is not None
        ci = _in_ci() or before == "ci"
        name = HYPOTHESIS_PROFILE["ci" if ci and not seeded else "dev"]
        try:
            settings.get_profile(name)
        except InvalidArgument:  # not registered yet (start() registers them)
            _register_hypothesis_profile()
        settings.load_profile(name)
    configuration: Any = hypothesis.configuration
    home_attr = "__hypothesis_home_directory"  # a module global: no name mangling
    home = getattr(configuration, home_attr, None)
    redirect = settings().database is None and not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY")
    if redirect:
        import tempfile

        scratch = Path(tempfile.gettempdir()) / "exportcheck-hypothesis"
        configuration.set_hypothesis_home_dir(scratch)
    try:
        yield
    finally:
        if redirect:
            configuration.set_hypothesis_home_dir(home)
        if ours:
            settings.load_profile(before)
