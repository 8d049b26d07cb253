"""Will a tokenizer's files load and its chat template compile? Found without running it.

:func:`json_problems`: every JSON file of a tokenizer (``tokenizer.json``, its config,
the special-tokens and added-tokens maps, ``vocab.json``, ``chat_template.json``) is a
JSON object, or transformers and vLLM fail to load the tokenizer.

:func:`chat_template_problems`: a checkpoint's chat template is Jinja source that
transformers' ``apply_chat_template`` (and so vLLM's and SGLang's chat endpoints)
compiles on the first chat request. One that does not compile loads without a word and
fails every request. The templates are found where transformers reads them:
``chat_template.jinja``, ``additional_chat_templates/*.jinja``, ``chat_template.json``'s
``chat_template`` (a processor's), and ``tokenizer_config.json``'s ``chat_template`` (a
string, or a list of ``{"name", "template"}``).

Each is compiled the way transformers compiles it (a sandboxed environment with
``trim_blocks`` / ``lstrip_blocks``, the ``loopcontrols`` extension and its
``{% generation %}`` block) with ``raw=True``: Jinja parses the source and generates
Python source text, which is never executed. That finds what the first request would
raise at compile time: a syntax error, an unclosed block, an unknown tag or filter.
Nothing checks what a template does when it renders.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["JSON_FILES", "chat_template_problems", "json_problems"]

#: The tokenizer files that hold one JSON object each.
JSON_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "chat_template.json",
)

_FOLDER = "additional_chat_templates/"


def json_problems(files: Mapping[str, bytes]) -> list[tuple[str, str]]:
    """``(file, what is wrong)`` for each of :data:`JSON_FILES` in ``files`` that is no JSON object."""
    problems = []
    for name in (n for n in files if n in JSON_FILES):
        try:
            value = json.loads(files[name].decode("utf-8"))
        except UnicodeDecodeError as err:
            problems.append((name, f"is not UTF-8 text ({err.reason} at byte {err.start})"))
        except json.JSONDecodeError as err:
            problems.append((name, f"is not valid JSON (line {err.lineno}: {err.msg})"))
        except RecursionError:
            problems.append((name, "is nested too deeply to parse"))
        else:
            if not isinstance(value, dict):
                problems.append((name, f"holds a JSON {type(value).__name__}, expected an object"))
    return problems


def chat_template_problems(files: Mapping[str, bytes]) -> list[tuple[str, str]]:
    """``(where, what is wrong)`` for each chat template in ``files`` that does not compile.

    Args:
        files: ``{name relative to the directory: bytes}`` of a tokenizer's files (as
            :func:`exportlm.hfdir.tokenizer_files` reads them). A JSON file that does not
            parse is left to :func:`json_problems`; its templates are not looked for.

    Returns:
        One pair per broken template, ``where`` naming the file (and the field or
        template name inside it), in the order the files are given.
    """
    problems = ((where, _problem(source)) for where, source in _templates(files))
    return [(where, problem) for where, problem in problems if problem is not None]


def _problem(source: Any) -> str | None:
    """Why ``source`` (a ``.jinja`` file's bytes, or a JSON field's value) is no template."""
    if isinstance(source, bytes):
        try:
            source = source.decode("utf-8")
        except UnicodeDecodeError as err:
            return f"is not UTF-8 text ({err.reason} at byte {err.start})"
    if not isinstance(source, str):
        return f"is a JSON {type(source).__name__}, expected the template's Jinja text"
    return _compile_problem(source)


def _templates(files: Mapping[str, bytes]) -> Iterator[tuple[str, Any]]:
    """``(where, template source)`` of every chat template the files hold."""
    for name, data in files.items():
        if name == "chat_template.jinja" or (name.startswith(_FOLDER) and name.endswith(".jinja")):
            yield name, data
        elif name in ("tokenizer_config.json", "chat_template.json"):
            yield from _json_templates(name, data)


def _json_templates(name: str, data: bytes) -> Iterator[tuple[str, Any]]:
    try:
        config = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return  # json_problems says what is wrong with it
    if not isinstance(config, dict) or config.get("chat_template") is None:
        return
    value = config["chat_template"]
    if isinstance(value, list):  # named templates: [{"name": ..., "template": ...}]
        for i, entry in enumerate(value):
            label = entry.get("name", i) if isinstance(entry, dict) else i
            template = entry.get("template") if isinstance(entry, dict) else entry
            yield f"{name}: chat_template[{label!r}]", template
    else:
        yield f"{name}: chat_template", value


def _compile_problem(source: str) -> str | None:
    """Why ``source`` does not compile as transformers compiles it, else ``None``."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_generation_extension(), "jinja2.ext.loopcontrols"],
    )
    try:
        environment.compile(source, raw=True)  # parse and generate; nothing runs
    except jinja2.TemplateSyntaxError as err:  # TemplateAssertionError too
        return f"does not compile: line {err.lineno}: {err.message}"
    except RecursionError:
        return "does not compile: it is nested too deeply to parse"
    return None


def _generation_extension() -> type:
    """transformers' ``{% generation %}...{% endgeneration %}`` block, for parsing only."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_generation")
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    return Generation
