"""An exportcheck JSON report as one self-contained HTML page, and as an SVG badge.

Pure data, standard library only, on the library's floor beside :mod:`exportlm._matrix`:
the plugin (``--export-report-html``) and the CLI (``exportlm report html``, which renders
a merge of shard reports the same way) both call :func:`report_html`.

The page carries everything inline (styles, one small script, no fonts, images or links
outside it), so a CI job can upload it as one artifact. A report is data from a CI run,
possibly of someone else's pull request: every string from it is HTML-escaped, and the
page's Content-Security-Policy allows only the one script it ships (by its hash), so a
message holding markup can neither run nor load anything.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from html import escape
from typing import Any

from exportlm._matrix import OUTCOMES, matrix_of, totals_of, unchecked_of

__all__ = ["report_badge", "report_html", "verdict_of"]

Item = Mapping[str, Any]

#: The one script of the page: opens the items of the cell a link or the address names,
#: and marks the body once it ran (the browser test reads that mark).
_SCRIPT = """
function openTarget() {
  var id = decodeURIComponent(location.hash.slice(1));
  var el = id && document.getElementById(id);
  if (el && el.tagName === "DETAILS") { el.open = true; el.scrollIntoView(); }
}
window.addEventListener("hashchange", openTarget);
document.addEventListener("DOMContentLoaded", function () {
  openTarget();
  document.body.setAttribute("data-ready", "1");
});
""".strip()

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1b1f23}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em}
table{border-collapse:collapse;margin:.5em 0}
th,td{border:1px solid #d0d7de;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f6f8fa}td.cell{text-align:center;white-space:nowrap}
td.pass{background:#dafbe1}td.fail{background:#ffd7d5}td.xfail{background:#fff3c4}
td.skip{background:#eef1f4}td.na{color:#8c959f}td.cell a{color:inherit}
.verdict{display:inline-block;padding:4px 10px;border-radius:4px;font-weight:600}
.v-passed{background:#2da44e;color:#fff}.v-failed{background:#cf222e;color:#fff}
.v-unchecked{background:#bf8700;color:#fff}
pre{white-space:pre-wrap;margin:0;max-width:110ch;font-size:12px}
details{margin:.3em 0}summary{cursor:pointer}
""".strip()

#: A verdict's badge colour (shields.io's palette).
_BADGE_COLOURS = {"passed": "#4c1", "unchecked": "#dfb317", "failed": "#e05d44"}
_CELL_ORDER = ("fail", "xfail", "skip", "pass")


def _outcome(item: Item) -> str:
    return str(item.get("outcome") or "")


def verdict_of(report: Mapping[str, Any]) -> str:
    """``"failed"`` (a failed, incomplete or unknown-outcome item, or an interrupted run),
    ``"unchecked"`` (no failure, but a row none of whose value checks ran), else ``"passed"``."""
    items = report.get("items", [])
    if report.get("interrupted") or any(
        _outcome(i) not in ("pass", "xfail", "skip") for i in items
    ):
        return "failed"
    if any(_judged_unchecked(report).values()):
        return "unchecked"
    return "passed"


def _judged_unchecked(report: Mapping[str, Any]) -> dict[str, list[str]]:
    """The report's unchecked rows less those its targets declare unchecked (with a reason)
    and those whose value checks were deselected: the rows ``--export-strict`` fails on."""
    declared = report.get("declared_unchecked") or {}
    narrowed = report.get("not_selected") or {}
    return {
        scope: [
            c
            for c in columns
            if c not in (declared.get(scope) or {}) and c not in (narrowed.get(scope) or ())
        ]
        for scope, columns in (report.get("unchecked") or {}).items()
    }


def _anchor(scope: str, column: str, check: str) -> str:
    digest = hashlib.sha256(f"{scope}\0{column}\0{check}".encode()).hexdigest()
    return f"cell-{digest[:16]}"


def _cell(
    scope: str, column: str, check: str, counts: Mapping[str, int] | None, why: str = ""
) -> str:
    if not counts or not sum(counts.values()):
        title = f"not applicable: {why}" if why else "no item"
        return f'<td class="cell na" title="{escape(title)}">&middot;</td>'
    total = sum(counts.values())
    kind = next(o for o in _CELL_ORDER if counts.get(o))
    flags = " ".join(
        f"{o[0].upper() if o == 'fail' else o[0]}{counts[o]}"
        for o in ("fail", "xfail", "skip")
        if counts.get(o)
    )
    text = f"{counts.get('pass', 0)}/{total}" + (f" {flags}" if flags else "")
    href = _anchor(scope, column, check)
    return f'<td class="cell {kind}"><a href="#{href}">{escape(text)}</a></td>'


def _matrix_table(
    scope: str,
    columns: Mapping[str, Mapping[str, Mapping[str, int]]],
    checks: Sequence[str],
    why: Mapping[tuple[str, str], str],
) -> str:
    head = "".join(f"<th>{escape(c)}</th>" for c in columns)
    rows = []
    for check in checks:
        cells = "".join(
            _cell(scope, col, check, columns[col].get(check), why.get((col, check), ""))
            for col in columns
        )
        rows.append(f"<tr><th>{escape(check)}</th>{cells}</tr>")
    return (
        f'<table class="matrix" data-scope="{escape(scope)}"><thead><tr>'
        f"<th>check \\ {escape(scope)}</th>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


def _check_order(items: Iterable[Item]) -> dict[str, tuple[int, str]]:
    return {str(i["check"]): (int(i.get("check_index", 0)), str(i["check"])) for i in items}


def _matrices(
    items: Sequence[Item],
    unchecked: Mapping[str, Sequence[str]],
    inapplicable: Sequence[Item],
    declared: Mapping[str, Mapping[str, str]],
) -> str:
    """One table per scope; a cell that cannot apply (``not_applicable``) titled with why."""
    order = _check_order([*items, *inapplicable])
    out = []
    for scope, columns in matrix_of(items).items():
        why = {
            (str(c["column"]), str(c["check"])): str(c["reason"])
            for c in inapplicable
            if c.get("scope") == scope
        }
        checks = {c for cells in columns.values() for c in cells}
        checks |= {check for column, check in why if column in columns}
        out.append(f"<h2>{escape(scope)} &times; check</h2>")
        out.append(_matrix_table(scope, columns, sorted(checks, key=order.__getitem__), why))
        if unchecked.get(scope):
            names = ", ".join(escape(str(c)) for c in unchecked[scope])
            out.append(
                f'<p class="unchecked">Unchecked ({escape(scope)}): no value check '
                f"ran (all skipped or xfailed): {names}</p>"
            )
        for column, reason in sorted((declared.get(scope) or {}).items()):
            out.append(
                f"<p>Declared unchecked ({escape(scope)} {escape(str(column))}, by its "
                f"target, not a failure): {escape(str(reason))}</p>"
            )
    return "\n".join(out)


def _profile(item: Item) -> str:
    profile = item.get("profile") or {}
    if not isinstance(profile, Mapping):
        return ""
    parts = [
        f"{k} {v:.2f}s" if isinstance(v, float) else f"{k} {v}" for k, v in sorted(profile.items())
    ]
    return escape(", ".join(parts))


def _item_row(item: Item) -> str:
    duration = item.get("duration")
    seconds = f"{float(duration):.2f}s" if isinstance(duration, int | float) else ""
    return (
        f"<tr><td>{escape(str(item.get('id', item.get('nodeid', ''))))}</td>"
        f'<td class="cell {escape(_outcome(item))}">{escape(_outcome(item) or "(none)")}</td>'
        f"<td>{seconds}</td><td>{_profile(item)}</td>"
        f"<td><pre>{escape(str(item.get('message', '')))}</pre></td></tr>"
    )


def _items_sections(items: Sequence[Item]) -> str:
    groups: dict[tuple[str, str, str], list[Item]] = {}
    for item in sorted(items, key=lambda i: str(i.get("nodeid", ""))):
        key = (str(item["scope"]), str(item["column"]), str(item["check"]))
        groups.setdefault(key, []).append(item)
    out = ["<h2>Items</h2>"]
    for (scope, column, check), group in sorted(groups.items()):
        counts = Counter(_outcome(i) for i in group)
        summary = ", ".join(f"{n} {o or '(none)'}" for o, n in sorted(counts.items()))
        out.append(
            f'<details id="{_anchor(scope, column, check)}"><summary>{escape(check)} '
            f"[{escape(column)}] ({escape(scope)}): {escape(summary)}</summary>"
            "<table><thead><tr><th>item</th><th>outcome</th><th>time</th><th>profile</th>"
            f"<th>message</th></tr></thead><tbody>{''.join(map(_item_row, group))}"
            "</tbody></table></details>"
        )
    return "\n".join(out)


def _served_rows(items: Iterable[Item]) -> Counter[tuple[str, ...]]:
    rows: Counter[tuple[str, ...]] = Counter()
    for item in items:
        details = item.get("details") or {}
        served = details.get("served") if isinstance(details, Mapping) else None
        for row in served if isinstance(served, list) else ():
            if isinstance(row, Mapping):
                key = ("engine", "engine_version", "target", "layout", "scheme", "dtype", "outcome")
                rows[tuple(str(row.get(k) or "") for k in key)] += 1
    return rows


def _engines_table(items: Iterable[Item]) -> str:
    rows = _served_rows(items)
    if not rows:
        return "<h2>Engines</h2><p>No artifact was served by an engine in this run.</p>"
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "engine",
            "version",
            "artifact of",
            "layout",
            "scheme",
            "dtype",
            "outcome",
            "rows",
        )
    )
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(v)}</td>" for v in key) + f"<td>{n}</td></tr>"
        for key, n in sorted(rows.items())
    )
    return (
        f'<h2>Engines &times; artifacts</h2><table class="engines"><thead><tr>{head}'
        f"</tr></thead><tbody>{body}</tbody></table>"
    )


def _kv_table(title: str, data: Mapping[str, Any]) -> str:
    body = "".join(
        f"<tr><th>{escape(str(k))}</th><td><pre>{escape(_plain(v))}</pre></td></tr>"
        for k, v in sorted(data.items())
    )
    return f"<h2>{escape(title)}</h2><table><tbody>{body}</tbody></table>"


def _plain(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _plugins_table(report: Mapping[str, Any]) -> str:
    plugins = [p for p in report.get("plugins", []) if isinstance(p, Mapping)]
    body = "".join(
        f"<tr><td>{escape(str(p.get('kind', '')))}</td><td>{escape(str(p.get('name', '')))}</td>"
        f"<td>{escape(str(p.get('provider', '')))}</td></tr>"
        for p in plugins
    )
    failures = "".join(
        f"<li><pre>{escape(_plain(f))}</pre></li>" for f in report.get("plugin_failures", [])
    )
    extra = f"<p>Plugins that failed to load:</p><ul>{failures}</ul>" if failures else ""
    return (
        f"<h2>Plugins</h2><table><thead><tr><th>kind</th><th>name</th><th>provider</th>"
        f"</tr></thead><tbody>{body}</tbody></table>{extra}"
    )


def _summary(report: Mapping[str, Any], items: Sequence[Item], verdict: str) -> str:
    totals = {
        **totals_of(i for i in items if _outcome(i) in OUTCOMES),
        **Counter(_outcome(i) or "(none)" for i in items if _outcome(i) not in OUTCOMES),
    }
    text = ", ".join(f"{n} {o}" for o, n in totals.items())
    merged = report.get("merged_from") or []
    lines = [
        f'<p><span class="verdict v-{verdict}" id="verdict">{verdict}</span> '
        f"{len(items)} items: {escape(text)}</p>"
    ]
    if report.get("interrupted"):
        lines.append(
            "<p><strong>The run was interrupted</strong>: unfinished items count as failed.</p>"
        )
    if merged:
        names = ", ".join(escape(str(m)) for m in merged)
        lines.append(f"<p>Merged from {len(merged)} report(s): {names}</p>")
    return "\n".join(lines)


def report_html(report: Mapping[str, Any], *, title: str = "exportcheck conformance") -> str:
    """The report as one self-contained HTML page (UTF-8 text).

    Sections: the verdict and totals; a check x target and a check x exporter matrix
    (each cell links to its items: outcome, time, profile, message); the engines x
    artifacts table of the ``served`` items with engine versions; the environment,
    options and plugins of the run. The matrix is computed from the items, so a merged
    report renders like a single run.
    """
    items = [i for i in report.get("items", []) if isinstance(i, Mapping)]
    report = {
        **report,
        "unchecked": report.get("unchecked") or unchecked_of(items, report.get("value_checks", {})),
    }
    unchecked = _judged_unchecked(report)
    verdict = verdict_of(report)
    digest = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
    csp = f"default-src 'none'; style-src 'unsafe-inline'; script-src 'sha256-{digest}'"
    body = [
        f"<h1>{escape(title)}</h1>",
        _summary(report, items, verdict),
        _matrices(
            items,
            unchecked,
            [c for c in report.get("not_applicable", []) if isinstance(c, Mapping)],
            report.get("declared_unchecked") or {},
        ),
        _engines_table(items),
        _kv_table("Environment", report.get("environment", {})),
        _kv_table("Options", report.get("options", {})),
        _plugins_table(report),
        _items_sections(items),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
        f"<title>{escape(title)}: {verdict}</title><style>{_STYLE}</style>"
        f"<script>{_SCRIPT}</script></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def _text_width(text: str) -> int:
    """Approximate pixel width of ``text`` in 11px Verdana (shields.io's badge font)."""
    return 7 * len(text) + 10


def report_badge(report: Mapping[str, Any], *, label: str = "exportcheck") -> str:
    """A static SVG badge: ``passed/total`` items, coloured by :func:`verdict_of`."""
    items = [i for i in report.get("items", []) if isinstance(i, Mapping)]
    verdict = verdict_of(report)
    passed = sum(_outcome(i) == "pass" for i in items)
    failed = sum(_outcome(i) not in ("pass", "xfail", "skip") for i in items)
    if verdict != "failed":
        value = f"{passed}/{len(items)} passed"
    else:
        value = f"{failed} failed" if failed else "interrupted"
    left, right = _text_width(label), _text_width(value)
    colour = _BADGE_COLOURS[verdict]
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + right}" height="20" '
        f'role="img" aria-label="{escape(label)}: {escape(value)}">'
        f"<title>{escape(label)}: {escape(value)}</title>"
        f'<rect width="{left}" height="20" fill="#555"/>'
        f'<rect x="{left}" width="{right}" height="20" fill="{colour}"/>'
        '<g fill="#fff" text-anchor="middle" font-family="Verdana,DejaVu Sans,sans-serif" '
        'font-size="11">'
        f'<text x="{left / 2}" y="14">{escape(label)}</text>'
        f'<text x="{left + right / 2}" y="14">{escape(value)}</text></g></svg>\n'
    )
