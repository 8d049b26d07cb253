"""The argument parser of ``exportlm``: ``list``, ``env``, ``export``, ``inspect``, ``report``.

``-v`` / ``-q`` are accepted before and after the subcommand and add up
(:func:`verbosity`). An argument error raises
:class:`~exportlm.cli._errors.UsageError` instead of exiting, so ``main``
reports every usage error the same way (one line, exit code 2).
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from pathlib import Path
from typing import NoReturn

from exportlm.calibration import DEFAULT_BATCH_SIZE, DEFAULT_SAMPLES, DEFAULT_SEQ_LEN
from exportlm.cli._errors import UsageError
from exportlm.cli._logging import PROG

__all__ = ["build_parser", "verbosity", "version_text"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def version_text() -> str:
    """``exportlm X (torch Y, Python Z)``, without importing torch."""
    from exportlm import __version__

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    python = ".".join(map(str, sys.version_info[:3]))
    return f"{PROG} {__version__} (torch {torch_version}, Python {python})"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


#: Seeds the toy models accept: numpy's PCG64 takes any non-negative integer; the
#: command line states a range that every seeded generator takes.
SEED_MAX = 2**64 - 1


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer from 0 to {SEED_MAX} (2**64 - 1), got {text!r}"
        ) from None
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(
            f"expected an integer from 0 to {SEED_MAX} (2**64 - 1), got {value}"
        )
    return value


def _shape(text: str) -> tuple[int, int]:
    """``BxS`` (``2x8``) as ``(batch, seq)``, both at least 1."""
    batch, sep, seq = text.lower().partition("x")
    if sep and batch.isdigit() and seq.isdigit() and int(batch) >= 1 and int(seq) >= 1:
        return int(batch), int(seq)
    raise argparse.ArgumentTypeError(
        f"expected BATCHxSEQUENCE with both at least 1 (such as 2x8), got {text!r}"
    )


def _add_verbosity(parser: argparse.ArgumentParser, where: str) -> None:
    parser.add_argument(
        "-v",
        "--verbose",
        dest=f"verbose_{where}",
        action="count",
        default=0,
        help="more output: -v debug lines from exportlm, -vv also from torch and other libraries",
    )
    parser.add_argument(
        "-q",
        "--quiet",
        dest=f"quiet_{where}",
        action="count",
        default=0,
        help="only warnings and errors on stderr, no progress bars",
    )


def verbosity(args: argparse.Namespace) -> int:
    """Number of ``-v`` minus number of ``-q``, wherever they were given."""
    return int(
        args.verbose_top
        + getattr(args, "verbose_sub", 0)
        - args.quiet_top
        - getattr(args, "quiet_sub", 0)
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``exportlm`` parser."""
    parser = _Parser(
        prog=PROG,
        description="Export decoder LMs through registered export targets. "
        "Exit codes: 0 ok, 1 export or verification failed, 2 usage error.",
    )
    parser.add_argument("--version", action="version", version=version_text())
    _add_verbosity(parser, "top")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p_list = sub.add_parser(
        "list", help="list targets, runtimes, module exporters and model families"
    )
    p_list.add_argument("--json", action="store_true", help="one JSON object on stdout")
    _add_verbosity(p_list, "sub")
    p_env = sub.add_parser("env", help="versions, devices and settings for a bug report")
    p_env.add_argument("--json", action="store_true", help="one JSON object on stdout")
    _add_verbosity(p_env, "sub")
    _add_export(sub.add_parser("export", help="export a model with a target"))
    p_inspect = sub.add_parser(
        "inspect",
        help="check a checkpoint directory or an .onnx file against the serving loaders' rules",
    )
    from exportlm.cli._inspect import add_inspect_arguments

    add_inspect_arguments(p_inspect)
    _add_verbosity(p_inspect, "sub")
    p_verify = sub.add_parser(
        "verify", help="serve an artifact in a real engine and compare it with the eager model"
    )
    from exportlm.cli._verify import add_verify_arguments

    add_verify_arguments(p_verify)
    _add_quantization(p_verify)
    _add_verbosity(p_verify, "sub")
    from exportlm.cli._report import add_report_arguments

    p_report = sub.add_parser(
        "report", help="merge exportcheck JSON reports (shards, devices), or render them as HTML"
    )
    for action in add_report_arguments(p_report):
        _add_verbosity(action, "sub")
    return parser


_TRUST_HELP = (
    "with --verify: load an artifact whose format can execute code (TorchScript, .pt2) "
    "even when no manifest signed on this machine vouches for it (see docs/security.md)"
)


def _add_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="export target name (see `exportlm list`)")
    p.add_argument(
        "--model",
        required=True,
        help="toy model family (decoder, decoder_tied, iterable_moe, hf:llama, hf:mixtral, ...), "
        "a model structure FILE.json (exportlm.models.ModelSpec) "
        "or a local Hugging Face model directory (never downloaded; one that needs code of "
        "its own, auto_map or *.py, is refused: exportlm never runs a checkpoint's code)",
    )
    p.add_argument("--out", required=True, type=Path, help="output file or directory")
    p.add_argument(
        "--seed",
        type=_seed,
        default=0,
        help="seed of toy model weights, 0 to 2**64 - 1 (default 0)",
    )
    p.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="target option, repeatable, parsed by the option's type "
        "(-o opset=19 -o dynamo=false -o dtype=bf16)",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="reload the artifact in its runtime and compare its logits with the eager model",
    )
    p.add_argument(
        "--verify-shape",
        action="append",
        type=_shape,
        default=None,
        metavar="BxS",
        help="with --verify: compare at input_ids of batch B and sequence S, repeatable "
        "(default 2x8, the traced shape); ids drawn as the conformance checks draw them",
    )
    p.add_argument("--trust", action="store_true", help=_TRUST_HELP)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    _add_quantization(p)
    _add_streaming(p)
    _add_verbosity(p, "sub")


def _add_streaming(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("streaming (hf_checkpoint from a model directory; docs/streaming.md)")
    s.add_argument(
        "--stream",
        action="store_true",
        help="export layer by layer even when the model fits (it does by itself when it does not)",
    )
    s.add_argument(
        "--max-memory",
        metavar="SIZE",
        help="memory budget such as 8GB (default: the cgroup limit, else the available memory); "
        "a model whose in-memory export would exceed it is exported layer by layer",
    )
    s.add_argument(
        "--stream-inputs",
        choices=("quantized", "float"),
        default=None,
        help="what each streamed layer is calibrated on: the outputs of the already quantized "
        "layers (quantized, default, as llm-compressor) or of the float ones (float: the "
        "in-memory export's scales, byte for byte)",
    )


def _add_quantization(p: argparse.ArgumentParser) -> None:
    q = p.add_argument_group("quantization")
    q.add_argument(
        "--quantize",
        metavar="RECIPE",
        help="fake-quantize first: fp8, nvfp4, int4_awq, int8_wo, int8_sq, w8a8, fp8_dynamic, "
        "int4_gptq, int8_gptq, fp8_block, mxfp4, mxfp8, w4a8_awq, w4afp8, "
        "optionally +fp8_kv; options after a colon, e.g. int4_awq:group_size=64 or int8_sq:alpha=0.5",
    )
    q.add_argument(
        "--exclude",
        metavar="PATTERN",
        action="append",
        default=None,
        help="fnmatch pattern of module names left unquantized, repeatable (lm_head, MoE "
        "routers and embeddings are by default), e.g. --exclude '*down_proj'",
    )
    q.add_argument(
        "--calib-data",
        metavar="PATH",
        type=Path,
        help="calibration texts: a text file (one sample per line), a .json list of strings, "
        "or a datasets save_to_disk directory (default: synthetic random ids, with a warning); "
        "a FIFO or device is refused",
    )
    q.add_argument(
        "--calib-samples",
        type=_positive_int,
        metavar="N",
        help=f"samples read from --calib-data (default {DEFAULT_SAMPLES}, or all if fewer)",
    )
    q.add_argument(
        "--calib-seq-len",
        type=_positive_int,
        metavar="L",
        help=f"tokens per calibration row (default {DEFAULT_SEQ_LEN}, capped by the model)",
    )
    q.add_argument(
        "--calib-batch-size",
        type=_positive_int,
        metavar="B",
        help=f"rows per calibration forward pass (default {DEFAULT_BATCH_SIZE})",
    )
