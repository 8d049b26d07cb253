"""``main``: parse, configure output, dispatch, and turn every error into one line and an exit code."""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys
from collections.abc import Callable, Sequence

from exportlm.cli._errors import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    exit_code,
)
from exportlm.cli._logging import PROG, cli_output
from exportlm.cli._parser import build_parser, verbosity
from exportlm.errors import ExportLMError

__all__ = ["main"]

logger = logging.getLogger("exportlm.cli")


def _run_list(args: argparse.Namespace) -> int:
    from exportlm.cli._list import cmd_list

    return cmd_list(args.json)


def _run_env(args: argparse.Namespace) -> int:
    from exportlm.cli._env import cmd_env

    return cmd_env(args.json)


def _run_export(args: argparse.Namespace) -> int:
    from exportlm.cli._export import cmd_export

    return cmd_export(args)


def _run_inspect(args: argparse.Namespace) -> int:
    from exportlm.cli._inspect import cmd_inspect

    return cmd_inspect(args)


def _run_verify(args: argparse.Namespace) -> int:
    from exportlm.cli._verify import cmd_verify

    return cmd_verify(args)


def _run_report(args: argparse.Namespace) -> int:
    from exportlm.cli._report import cmd_report

    return cmd_report(args)


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "list": _run_list,
    "env": _run_env,
    "export": _run_export,
    "inspect": _run_inspect,
    "verify": _run_verify,
    "report": _run_report,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``exportlm`` console script and of ``python -m exportlm``.

    Returns the exit code: 0 ok, 1 the export, quantization or verification
    failed, 2 a usage error (bad arguments or option values, unknown names,
    missing paths), 130 interrupted. Errors are one line on stderr; ``-v`` adds
    the traceback.
    """
    stderr = sys.stderr
    try:
        args = build_parser().parse_args(argv)
    except UsageError as err:
        stderr.write(f"{PROG}: error: {err}\n")
        return EXIT_USAGE
    except SystemExit as done:  # --help and --version print and exit
        return done.code if isinstance(done.code, int) else EXIT_OK
    if args.command is None:
        stderr.write(
            f"{PROG}: error: missing command: {', '.join(sorted(_COMMANDS))} "
            f"(see `{PROG} --help`)\n"
        )
        return EXIT_USAGE
    level = verbosity(args)
    with cli_output(level, stderr):
        try:
            return _COMMANDS[args.command](args)
        except KeyboardInterrupt:
            logger.error("interrupted")
            return EXIT_INTERRUPTED
        except BrokenPipeError:  # stdout closed early (`exportlm list --json | head`): no noise
            _silence_stdout()
            return EXIT_FAILURE
        except Exception as err:  # every error becomes one line and an exit code
            logger.error("%s", _one_line(err, level), exc_info=level > 0)
            return exit_code(err)


def _silence_stdout() -> None:
    """Point stdout at devnull, so the interpreter's final flush raises no second BrokenPipeError.

    What the Python documentation recommends for SIGPIPE ("Note on SIGPIPE" in the
    signal module's documentation).
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):  # stdout without a file descriptor
        pass


def _one_line(error: BaseException, level: int) -> str:
    """The error's message; a library's own exception is prefixed with its type."""
    text = str(error).strip() or type(error).__name__
    if not isinstance(error, ExportLMError):
        text = f"{type(error).__name__}: {text}"
    lines = text.splitlines()
    if len(lines) > 1 and level <= 0:
        return f"{lines[0]} [{len(lines) - 1} more line(s) with -v]"
    if level <= 0 and not isinstance(error, ExportLMError):
        return f"{text} (run with -v for the traceback)"
    return text
