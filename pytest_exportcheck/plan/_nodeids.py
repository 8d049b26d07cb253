"""Node ids of the suite's items, and the suite's node ids given as command-line arguments.

Every item lives under one ``exportcheck`` collector and one collector per check::

    exportcheck::roundtrip_logits::roundtrip_logits[onnx-llama-cpu]

so JUnit XML, which makes a test's ``classname`` of every part of its node id
but the last, gets one class per check (``exportcheck.roundtrip_logits``) and
the item id as the test name. A node id on the command line selects like a
test path does in pytest; the item id form, without the check collector, is
accepted too::

    pytest exportcheck                                     # the selected suite
    pytest exportcheck::roundtrip_logits                   # one check
    pytest "exportcheck::roundtrip_logits[onnx-llama-cpu]"  # one item
    pytest "exportcheck::roundtrip_logits::roundtrip_logits[onnx-llama-cpu]"

Run from a directory below the rootdir, pytest prints node ids relative to it
(``../exportcheck::trust::trust[onnx-cpu]``, as it would a test file's): those are
accepted too, so the id on a FAILED line reruns from the directory it was printed
in. A file or directory named ``exportcheck`` where the argument points wins over
these: such an argument is left to pytest. Imports only pytest.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = [
    "ROOT",
    "SuiteArgs",
    "check_nodeid",
    "item_id_of",
    "item_nodeid",
    "last_failed_args",
    "split_suite_args",
]

#: Name (and node id) of the collector holding every item of the suite.
ROOT = "exportcheck"
_SEP = "::"
_CHECK = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_ITEM = re.compile(r"(?P<check>[A-Za-z_][A-Za-z0-9_]*)\[(?P<params>[^\[\]\s]+)\]\Z")
#: ``exportcheck`` as pytest prints it from a directory ``n`` levels below the rootdir.
_ROOT_PATH = re.compile(r"(?:\.\.[/\\])*" + ROOT + r"[/\\]?\Z")


def check_nodeid(check: str) -> str:
    """The node id of the collector of ``check``'s items: ``exportcheck::<check>``."""
    return f"{ROOT}{_SEP}{check}"


def item_nodeid(check: str, item_id: str) -> str:
    """The node id of the item ``item_id`` (``<check>[<params>]``) of ``check``."""
    return f"{check_nodeid(check)}{_SEP}{item_id}"


def item_id_of(text: str) -> str | None:
    """The item id (``check[params]``) a suite node id names, or ``None`` if it names none.

    Accepts ``exportcheck::<check>::<check>[<params>]`` and the short form
    ``exportcheck::<check>[<params>]``, also as printed from below the rootdir
    (``../exportcheck::...``).
    """
    parts = text.split(_SEP)
    if not _ROOT_PATH.match(parts[0]) or len(parts) not in (2, 3):
        return None
    match = _ITEM.match(parts[-1])
    if match is None or (len(parts) == 3 and parts[1] != match["check"]):
        return None
    return parts[-1]


@dataclass(frozen=True)
class SuiteArgs:
    """The suite's node ids among the command-line arguments.

    ``whole``: ``exportcheck`` was given; ``checks``: check ids given as
    ``exportcheck::<check>``; ``items``: item ids given as (long or short) node
    ids, with the argument each came from; ``lenient``: they come from pytest's
    ``cache/lastfailed`` (:func:`last_failed_args`), where a vanished item is no error.
    """

    whole: bool = False
    checks: frozenset[str] = frozenset()
    items: tuple[tuple[str, str], ...] = ()
    #: Items that no longer exist are dropped, not a usage error (``--lf`` reruns).
    lenient: bool = False

    def __bool__(self) -> bool:
        return self.whole or bool(self.checks) or bool(self.items)

    @property
    def item_ids(self) -> frozenset[str]:
        """The item ids named one by one."""
        return frozenset(item for item, _ in self.items)


def _suite_arg(arg: str, invocation_dir: Path) -> str | None:
    """``arg`` with its path part written ``exportcheck``, or ``None`` if it is no suite id.

    The path part is ``exportcheck``, or ``../exportcheck`` and so on (pytest's
    rendering of a node id relative to an invocation directory below the rootdir);
    a file or directory at that path makes it pytest's argument instead.
    """
    path, sep, rest = arg.partition(_SEP)
    if not _ROOT_PATH.match(path):
        return None
    try:
        if (invocation_dir / path).exists():
            return None
    except OSError:  # pragma: no cover - an unreadable directory: leave the argument to pytest
        return None
    return (ROOT + sep + rest).rstrip("/")


def split_suite_args(args: Iterable[str], invocation_dir: Path) -> tuple[SuiteArgs, list[str]]:
    """``(the suite's node ids, the other arguments)``; a malformed suite node id is a usage error."""
    whole = False
    checks: set[str] = set()
    items: list[tuple[str, str]] = []
    rest: list[str] = []
    for arg in args:
        suite_arg = _suite_arg(arg, invocation_dir)
        if suite_arg is None:
            rest.append(arg)
            continue
        parts = suite_arg.split(_SEP)
        if len(parts) == 1:
            whole = True
        elif len(parts) == 2 and _CHECK.match(parts[1]):
            checks.add(parts[1])
        elif (item := item_id_of(suite_arg)) is not None:
            items.append((item, arg))
        else:
            raise pytest.UsageError(
                f"{arg!r} is not a node id of the exportcheck suite; expected {ROOT}, "
                f"{ROOT}::<check>, {ROOT}::<check>[<params>] or "
                f"{ROOT}::<check>::<check>[<params>], as printed on a FAILED line "
                f"(e.g. {item_nodeid('roundtrip_logits', 'roundtrip_logits[onnx-decoder-cpu]')})"
            )
    return SuiteArgs(whole, frozenset(checks), tuple(items)), rest


def last_failed_args(lastfailed: object) -> SuiteArgs:
    """The suite's items among pytest's ``cache/lastfailed`` record (``{node id: true}``).

    What a bare ``pytest --lf`` after a failed suite run plans: those items,
    whatever the ``--export-*`` selection was; items that no longer exist are
    dropped (``lenient``).
    """
    if not isinstance(lastfailed, dict):
        return SuiteArgs()
    items = []
    for nodeid in sorted(k for k in lastfailed if isinstance(k, str)):
        item = item_id_of(nodeid)
        if item is not None:
            items.append((item, nodeid))
    return SuiteArgs(items=tuple(items), lenient=True)
