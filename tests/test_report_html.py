"""The HTML report and the SVG badge: what a person opens after a CI run.

Rendered from report data (``exportlm._report_html``), then opened in a real headless
browser (Debian's ``chromium``): the page's script runs under its own
Content-Security-Policy, nothing is printed on the console, every cell links to its
items, and a report carrying markup in a message shows it as text.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from exportlm._report_html import report_badge, report_html, verdict_of

_EVIL = '<script>document.title="pwned"</script><img src=x onerror=alert(1)>'


def _item(check: str, column: str, outcome: str, scope: str = "target", **extra: Any) -> dict:
    return {
        "id": f"{check}[{column}-cpu]",
        "nodeid": f"exportcheck::{check}[{column}-cpu]",
        "check": check,
        "check_index": {"roundtrip_logits": 0, "served": 1, "mro_match": 2}.get(check, 3),
        "scope": scope,
        "column": column,
        "outcome": outcome,
        "duration": 0.5,
        "message": extra.pop("message", ""),
        "profile": {"export": 0.25, "artifact": "exported"},
        **extra,
    }


def _report(*items: dict, **extra: Any) -> dict:
    return {
        "format": 1,
        "environment": {"exportlm": "0.1.0", "torch": "2.13.0+cpu"},
        "options": {"targets": "all"},
        "plugins": [{"kind": "target", "name": "onnx", "provider": "exportlm (built in)"}],
        "plugin_failures": [],
        "value_checks": {"target": ["roundtrip_logits", "served"], "exporter": ["mro_match"]},
        "items": list(items),
        **extra,
    }


_SERVED = {
    "served": [
        {
            "engine": "vllm",
            "engine_version": "0.32.0",
            "target": "hf_checkpoint",
            "layout": "compressed-tensors",
            "scheme": "W8A8",
            "dtype": "bfloat16",
            "outcome": "passed",
        }
    ]
}


def _mixed() -> dict:
    return _report(
        _item("roundtrip_logits", "onnx", "pass"),
        _item("roundtrip_logits", "torchscript:trace", "fail", message=_EVIL),
        _item("served", "hf_checkpoint", "pass", details=_SERVED),
        _item("mro_match", "quant_linear", "pass", scope="exporter"),
        _item("mro_match", "bmm_experts", "skip", scope="exporter", message="no MoE"),
    )


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []
        self.ids: set[str] = set()
        self.scripts = 0
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        self.tags.append(tag)
        self.scripts += tag == "script"
        if values.get("id"):
            self.ids.add(str(values["id"]))
        if tag == "a" and str(values.get("href", "")).startswith("#"):
            self.hrefs.append(str(values["href"])[1:])


def test_every_matrix_cell_links_to_its_items() -> None:
    parser = _Links()
    parser.feed(report_html(_mixed()))
    assert len(parser.hrefs) == 5  # one cell per (column, check) that has items
    assert set(parser.hrefs) <= parser.ids


def test_markup_in_a_report_is_text_not_markup() -> None:
    page = report_html(_mixed())
    parser = _Links()
    parser.feed(page)
    assert parser.scripts == 1  # the page's own script only
    assert "img" not in parser.tags
    assert "&lt;script&gt;document.title=&quot;pwned&quot;&lt;/script&gt;" in page


def test_a_cell_that_cannot_apply_is_a_dot_titled_with_its_reason() -> None:
    gap = {
        "scope": "target",
        "column": "onnx",
        "check": "loadable",
        "reason": f"target 'onnx' writes a file artifact {_EVIL}",
        "items": 11,
        "check_index": 4,
    }
    page = report_html({**_mixed(), "not_applicable": [gap, "garbage"]})
    row = re.search(r"<tr><th>loadable</th>(.*?)</tr>", page)
    assert row is not None, page  # its row is shown though no column has an item of it
    assert 'title="not applicable: target &#x27;onnx&#x27; writes a file artifact &lt;script' in (
        row.group(1)
    )
    assert row.group(1).count('title="no item"') == 2  # the other columns: no item, no reason
    assert "<img" not in page


def test_the_engine_table_names_engine_versions() -> None:
    page = report_html(_mixed())
    assert "<td>vllm</td><td>0.32.0</td><td>hf_checkpoint</td>" in page
    no_engine = report_html(_report(_item("roundtrip_logits", "onnx", "pass")))
    assert "No artifact was served by an engine in this run." in no_engine


@pytest.mark.parametrize(
    ("report", "verdict"),
    [
        (_report(_item("roundtrip_logits", "onnx", "pass")), "passed"),
        (_report(_item("roundtrip_logits", "onnx", "fail")), "failed"),
        (_report(_item("roundtrip_logits", "onnx", "incomplete")), "failed"),
        (_report(_item("roundtrip_logits", "onnx", "")), "failed"),
        (_report(_item("roundtrip_logits", "onnx", "pass"), interrupted=True), "failed"),
        (
            _report(_item("roundtrip_logits", "onnx", "skip"), unchecked={"target": ["onnx"]}),
            "unchecked",
        ),
        # a row its target declares unchecked, or whose value checks were deselected, is
        # not one --export-strict fails on: the run passed
        (
            _report(
                _item("roundtrip_logits", "onnx", "skip"),
                unchecked={"target": ["onnx"]},
                declared_unchecked={"target": {"onnx": "no toy family scripts"}},
            ),
            "passed",
        ),
        (
            _report(
                _item("roundtrip_logits", "onnx", "skip"),
                unchecked={"target": ["onnx"]},
                not_selected={"target": ["onnx"]},
            ),
            "passed",
        ),
    ],
)
def test_verdict_counts_unfinished_items_as_failures(report: dict, verdict: str) -> None:
    assert verdict_of(report) == verdict
    assert f'class="verdict v-{verdict}"' in report_html(report)


def test_badge_is_svg_with_count_and_verdict_colour() -> None:
    passing = _report(_item("roundtrip_logits", "onnx", "pass"), _item("served", "onnx", "skip"))
    svg = ET.fromstring(report_badge(passing))
    texts = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert texts == ["exportcheck", "1/2 passed"]
    fills = [r.get("fill") for r in svg.iter("{http://www.w3.org/2000/svg}rect")]
    assert fills[-1] == "#4c1"
    failing = ET.fromstring(report_badge(_mixed()))
    assert [t.text for t in failing.iter("{http://www.w3.org/2000/svg}text")][-1] == "1 failed"
    assert [r.get("fill") for r in failing.iter("{http://www.w3.org/2000/svg}rect")][-1] == (
        "#e05d44"
    )


# -- in a real browser --------------------------------------------------------------

_CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _browser(page: Path, *args: str, fragment: str = "") -> tuple[str, str]:
    if _CHROMIUM is None:
        if os.environ.get("EXPORTLM_REQUIRE_BROWSER"):
            pytest.fail("EXPORTLM_REQUIRE_BROWSER is set but no chromium is on PATH")
        pytest.skip("no chromium on PATH (apt-get install chromium) to open the HTML report")
    done = subprocess.run(
        [
            _CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            *args,
            page.as_uri() + (f"#{fragment}" if fragment else ""),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, done.stderr


def _console(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def test_browser_probe_sees_console_errors(tmp_path: Path) -> None:
    """The control: the probe below would see a script error or a blocked script."""
    page = tmp_path / "bad.html"
    page.write_text("<!DOCTYPE html><body><script>undefinedFn()</script></body>")
    _, stderr = _browser(page, "--dump-dom")
    assert any("undefinedFn" in line for line in _console(stderr))


def test_report_opens_in_a_browser_without_console_errors(tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    page.write_text(report_html(_mixed()), encoding="utf-8")
    dom, stderr = _browser(page, "--dump-dom")
    assert _console(stderr) == []
    assert '<body data-ready="1">' in dom  # the page's script ran under its CSP
    assert "<title>exportcheck conformance: failed</title>" in dom  # the message ran nothing
    shot = tmp_path / "report.png"
    _browser(page, f"--screenshot={shot}", "--window-size=1200,900")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_cell_link_opens_its_items_in_the_browser(tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    page.write_text(report_html(_mixed()), encoding="utf-8")
    parser = _Links()
    parser.feed(page.read_text())
    anchor = parser.hrefs[0]
    dom, _ = _browser(page, "--dump-dom", fragment=anchor)
    assert f'<details id="{anchor}" open="">' in dom


# -- from the plugin and the CLI --------------------------------------------------------

#: A run without exports: two cheap checks, one of them turned into a failure by a strict
#: expected failure that passes (as tests/test_plugin_reporting.py does).
_SUITE = [
    "--export-targets=torch_export,torchscript",
    "--export-checks=plugin_loads,registered",
    "--export-xfails-file=xfails.txt",
    "-p",
    "no:cacheprovider",
]


@pytest.fixture
def plugin_run(pytester: pytest.Pytester) -> pytest.Pytester:
    (pytester.path / "xfails.txt").write_text("exportcheck::plugin_loads[torchscript:trace]\n")
    result = pytester.runpytest(
        *_SUITE,
        "--export-report=r.json",
        "--export-report-html=pages/r.html",
        "--export-report-badge=pages/b.svg",
    )
    result.assert_outcomes(passed=5, failed=1)
    result.stdout.fnmatch_lines(["HTML report: *pages/r.html", "badge: *pages/b.svg"])
    return pytester


def test_the_plugin_writes_the_page_and_the_badge(plugin_run: pytest.Pytester) -> None:
    page = (plugin_run.path / "pages" / "r.html").read_text()
    parser = _Links()
    parser.feed(page)
    assert len(parser.hrefs) == 6  # 3 rows x 2 checks, each cell linking to its items
    assert set(parser.hrefs) <= parser.ids
    assert 'class="verdict v-failed"' in page
    assert "<td>plugin_loads[torchscript:trace]</td>" in page
    assert str(plugin_run.path) not in page  # the same redaction as the JSON report
    svg = ET.fromstring((plugin_run.path / "pages" / "b.svg").read_text())
    assert [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")][-1] == "1 failed"
    dom, stderr = _browser(plugin_run.path / "pages" / "r.html", "--dump-dom")
    assert _console(stderr) == []
    assert '<body data-ready="1">' in dom


def test_the_cli_renders_a_report_and_refuses_a_malformed_one(
    plugin_run: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    from exportlm.cli import main

    out, badge = plugin_run.path / "cli.html", plugin_run.path / "cli.svg"
    report = str(plugin_run.path / "r.json")
    assert main(["report", "html", report, "-o", str(out), "--badge", str(badge)]) == 0
    assert capsys.readouterr().out.strip() == f"{out}: 6 items from 1 report(s), failed"
    assert 'class="verdict v-failed"' in out.read_text()
    assert badge.read_text().startswith("<svg ")
    broken = plugin_run.path / "broken.json"
    broken.write_text('{"format": 99, "items": []}')
    assert main(["report", "html", str(broken), "-o", str(plugin_run.path / "x.html")]) == 2
    assert "broken.json" in capsys.readouterr().err
    assert not (plugin_run.path / "x.html").exists()


def test_a_declared_unchecked_row_is_shown_with_its_reason() -> None:
    page = report_html(
        _report(
            _item("roundtrip_logits", "torchscript:script", "xfail"),
            unchecked={"target": ["torchscript:script"]},
            declared_unchecked={"target": {"torchscript:script": "no toy family <scripts>"}},
        )
    )
    assert 'class="verdict v-passed"' in page
    assert "Declared unchecked (target torchscript:script, by its target, not a failure): " in page
    assert "no toy family &lt;scripts&gt;" in page
