"""``re.match(entry, name)`` for config entries, in time linear in the name and without backtracking.

transformers matches ``modules_to_not_convert`` entries as regular expressions
(``should_convert_module``: ``re.match``), and Python's ``re`` backtracks: an entry such as
``"a*" * 12 + "b"`` against a long name runs for minutes. Here an entry is parsed by Python's
own parser (``re._parser``, the one ``re.compile`` uses: the same reading of every escape,
class, group and repeat), then run as a set of automaton states over the name (Thompson's
construction): ``O(len(name) x states)``, whatever the entry. Whether ``re.match`` finds a
match does not depend on the order its backtracking tries alternatives in, so for the
constructs read here (literals, ``.``, classes, ``\\d`` / ``\\w`` / ``\\s``, groups, alternation,
greedy and lazy repeats, ``^`` / ``$`` / ``\\A`` / ``\\Z`` / ``\\b`` / ``\\B``) the answer is
``re.match``'s. What a set of states cannot follow (backreferences, lookarounds, atomic groups,
possessive repeats, conditionals), inline flags, and an entry of more than :data:`MAX_STATES`
states are not matched: :func:`compile_entry` says why, for the caller to report.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_STATES", "EntryMatcher", "compile_entry"]

#: The most automaton states an entry may take (``x{500}`` is 500): matching a name costs up to
#: ``len(name) x MAX_STATES`` steps; module-name entries take tens.
MAX_STATES = 1000
#: ``re``'s flags an entry may carry: UNICODE (every ``str`` pattern's) and VERBOSE (parse only).
_PLAIN_FLAGS = 32 | 64

_Char = Callable[[str], bool]
#: ``("char", test, next)``, ``("split", [next, ...])``, ``("at", code, next)`` or ``("end",)``.
_State = tuple[Any, ...]


class _Unsupported(Exception):
    """An entry (or a part of it) the automaton does not follow; the message says what."""


def _word(char: str) -> bool:
    return char.isalnum() or char == "_"  # sre's Unicode \w (Py_UNICODE_ISALNUM or '_')


_CATEGORIES: dict[str, _Char] = {
    "CATEGORY_DIGIT": str.isdecimal,  # sre's Unicode \d (Py_UNICODE_ISDECIMAL)
    "CATEGORY_NOT_DIGIT": lambda c: not c.isdecimal(),
    "CATEGORY_SPACE": str.isspace,
    "CATEGORY_NOT_SPACE": lambda c: not c.isspace(),
    "CATEGORY_WORD": _word,
    "CATEGORY_NOT_WORD": lambda c: not _word(c),
}


def _is(char: str) -> _Char:
    return lambda c: c == char


def _is_not(char: str) -> _Char:
    return lambda c: c != char


def _within(low: int, high: int) -> _Char:
    return lambda c: low <= ord(c) <= high


def _class(items: list[tuple[Any, Any]]) -> _Char:
    """The test of a class (``IN``): ``[a-z\\d]``, ``[^.]``, ``\\w`` and ``(0|1)`` (read as one)."""
    negate = bool(items) and str(items[0][0]) == "NEGATE"
    tests: list[_Char] = []
    for op, av in items[1:] if negate else items:
        name = str(op)
        if name == "LITERAL":
            tests.append(_is(chr(av)))
        elif name == "RANGE":
            tests.append(_within(av[0], av[1]))
        elif name == "CATEGORY" and str(av) in _CATEGORIES:
            tests.append(_CATEGORIES[str(av)])
        else:
            raise _Unsupported(f"a class item {name} {av}")
    return lambda c: any(t(c) for t in tests) != negate


def _at(code: str, text: str, pos: int) -> bool:
    """Whether the zero-width assertion ``code`` holds at ``pos`` (sre's, without MULTILINE)."""
    if code in ("AT_BEGINNING", "AT_BEGINNING_STRING"):
        return pos == 0
    if code == "AT_END":  # '$': the end, or before a newline that ends the text
        return pos == len(text) or (pos == len(text) - 1 and text[pos] == "\n")
    if code == "AT_END_STRING":
        return pos == len(text)
    if not text:  # sre: neither \b nor \B holds in an empty text
        return False
    before = pos > 0 and _word(text[pos - 1])
    after = pos < len(text) and _word(text[pos])
    return (before != after) == (code == "AT_BOUNDARY")


_AT_CODES = frozenset(
    {"AT_BEGINNING", "AT_BEGINNING_STRING", "AT_END", "AT_END_STRING", "AT_BOUNDARY",
     "AT_NON_BOUNDARY"}
)  # fmt: skip
_NOT_FOLLOWED = {
    "GROUPREF": "a backreference",
    "GROUPREF_EXISTS": "a conditional group",
    "ASSERT": "a lookahead / lookbehind",
    "ASSERT_NOT": "a negative lookahead / lookbehind",
    "ATOMIC_GROUP": "an atomic group",
    "POSSESSIVE_REPEAT": "a possessive repeat",
}


class _Builder:
    """Thompson's construction, from the end: each item is compiled knowing its successor."""

    def __init__(self) -> None:
        self.states: list[_State] = [("end",)]

    def add(self, state: _State) -> int:
        if len(self.states) >= MAX_STATES:
            raise _Unsupported(
                f"more than {MAX_STATES} automaton states (a long or repeated entry)"
            )
        self.states.append(state)
        return len(self.states) - 1

    def sequence(self, items: Any, after: int) -> int:
        for item in reversed(list(items)):
            after = self.item(item, after)
        return after

    def item(self, item: tuple[Any, Any], after: int) -> int:
        op, av = item
        name = str(op)
        if name in _NOT_FOLLOWED:
            raise _Unsupported(_NOT_FOLLOWED[name])
        if name == "LITERAL":
            return self.add(("char", _is(chr(av)), after))
        if name == "NOT_LITERAL":
            return self.add(("char", _is_not(chr(av)), after))
        if name == "ANY":  # without DOTALL: any character but a newline
            return self.add(("char", _is_not("\n"), after))
        if name == "IN":
            return self.add(("char", _class(list(av)), after))
        if name == "AT" and str(av) in _AT_CODES:
            return self.add(("at", str(av), after))
        if name == "BRANCH":
            return self.add(("split", [self.sequence(alt, after) for alt in av[1]]))
        if name == "SUBPATTERN":
            _, add_flags, del_flags, body = av
            if add_flags or del_flags:
                raise _Unsupported("a group with inline flags ((?i:...), (?s:...))")
            return self.sequence(body, after)
        if name in ("MAX_REPEAT", "MIN_REPEAT"):  # lazy or greedy: the same matches exist
            return self.repeat(av, after)
        raise _Unsupported(f"{name} {av}")

    def repeat(self, av: tuple[int, Any, Any], after: int) -> int:
        low, high, body = av
        states = len(self.states)
        if self.sequence(body, after) == after and len(self.states) == states:
            return after  # an empty body ((?:){9999}): repeated, it still reads nothing
        if str(high) == "MAXREPEAT":  # body*: a split that loops back through the body
            loop = self.add(("split", []))
            self.states[loop] = ("split", [self.sequence(body, loop), after])
            start = loop
        else:  # the optional copies, nested: x{0,2} = (x(x)?)?
            start = after
            for _ in range(high - low):
                start = self.add(("split", [self.sequence(body, start), after]))
        for _ in range(low):
            start = self.sequence(body, start)
        return start


@dataclass(frozen=True)
class EntryMatcher:
    """An entry compiled to automaton states: :meth:`match` is ``bool(re.match(entry, text))``."""

    entry: str
    states: tuple[_State, ...]
    start: int

    def _closure(self, states: set[int], text: str, pos: int) -> set[int]:
        """``states`` and every state reached from them reading nothing at ``pos``."""
        stack, seen = list(states), set()
        while stack:
            state = stack.pop()
            if state in seen:
                continue
            seen.add(state)
            edge = self.states[state]
            if edge[0] == "split":
                stack.extend(edge[1])
            elif edge[0] == "at" and _at(edge[1], text, pos):
                stack.append(edge[2])
        return seen

    def match(self, text: str) -> bool:
        """Whether the entry matches a prefix of ``text`` (``re.match``), in
        ``O(len(text) x states)``."""
        current = self._closure({self.start}, text, 0)
        for pos, char in enumerate(text):
            if 0 in current or not current:  # state 0: the end, a prefix matched
                break
            steps = (self.states[s] for s in current)
            current = self._closure(
                {e[2] for e in steps if e[0] == "char" and e[1](char)}, text, pos + 1
            )
        return 0 in current


def compile_entry(entry: str) -> EntryMatcher | str:
    """``entry`` as an :class:`EntryMatcher`, or why it is not matched here (a phrase: "a
    backreference"). ``entry`` must compile (``re.compile``); the caller checks that first."""
    try:
        parser = importlib.import_module("re._parser")
    except ImportError:  # pragma: no cover - every CPython from 3.11 has it
        return "no re._parser in this Python to read it with"
    parsed = parser.parse(entry)
    if parsed.state.flags & ~_PLAIN_FLAGS:
        return "inline flags ((?i), (?m), (?s), (?a), (?L))"
    builder = _Builder()
    try:
        start = builder.sequence(parsed, 0)
    except _Unsupported as why:
        return str(why)
    except RecursionError:  # re.compile read it, on a shallower stack
        return "groups nested too deep"
    return EntryMatcher(entry, tuple(builder.states), start)
