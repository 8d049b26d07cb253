"""JUnit XML (``--junitxml``): the run's environment and each item's record, as JSON strings.

Suite level, in both families: ``exportcheck.version.<library>``,
``exportcheck.cuda``, ``exportcheck.options`` and ``exportcheck.plugins`` (JSON).
Per item: the xunit1 family (``-o junit_family=xunit1``) allows properties on a
``testcase``, so each item gets ``exportcheck`` (its coordinates) and
``exportcheck.result`` (status, message, details); the xunit2 schema (pytest's
default family) allows none there, so each item's record is one suite-level
``exportcheck.item`` property instead. A test's ``classname`` comes from its
node id (``exportcheck.roundtrip_logits``, see :mod:`pytest_exportcheck.plan._nodeids`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import pytest

from pytest_exportcheck.session.reporting._report import ItemRecord

__all__ = ["add_suite_properties", "testcase_properties", "wants_testcase_properties"]

_TESTCASE_FAMILIES = ("xunit1", "legacy")


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def wants_testcase_properties(config: pytest.Config) -> bool:
    """Whether JUnit XML is written in a family that allows ``testcase`` properties.

    Reads the public option and ini value, so it gives the same answer on xdist
    workers (which write no XML but build the reports that carry the properties).
    """
    if not config.getoption("xmlpath", None):
        return False
    return str(config.getini("junit_family")) in _TESTCASE_FAMILIES


def testcase_properties(record: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The ``testcase`` properties of one item's record (``{"item": ..., "result": ...}``)."""
    properties = [("exportcheck", _dumps(record["item"]))]
    if record.get("result") is not None:
        properties.append(("exportcheck.result", _dumps(record["result"])))
    return properties


def _log_xml(config: pytest.Config) -> Any | None:
    """The JUnit XML writer of this run, or ``None`` (no ``--junitxml``, or an xdist worker).

    pytest hands it to tests only (the ``record_testsuite_property`` fixture) and
    has no public accessor for plugins; this reads the stash key that fixture reads.
    """
    try:
        from _pytest.junitxml import xml_key
    except ImportError:  # pragma: no cover - a pytest without it writes no properties
        return None
    return config.stash.get(xml_key, None)


def add_suite_properties(
    config: pytest.Config, env: Mapping[str, Any], records: Iterable[ItemRecord]
) -> None:
    """Add the suite-level properties (and, for xunit2, the item records) to the XML."""
    xml = _log_xml(config)
    if xml is None:
        return
    for name, version in env["environment"].items():
        if name == "cuda":
            xml.add_global_property("exportcheck.cuda", str(version))
        else:
            xml.add_global_property(f"exportcheck.version.{name}", version or "")
    xml.add_global_property("exportcheck.options", _dumps(env["options"]))
    xml.add_global_property("exportcheck.plugins", _dumps(env["plugins"]))
    if env["plugin_failures"]:
        xml.add_global_property("exportcheck.plugin_failures", _dumps(env["plugin_failures"]))
    if getattr(xml, "family", "xunit2") not in _TESTCASE_FAMILIES:
        for record in records:
            xml.add_global_property("exportcheck.item", _dumps(record.as_json()))
