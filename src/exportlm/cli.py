"""``exportlm`` command line: ``list`` what is registered, ``export`` a model."""

from __future__ import annotations

import argparse
import ast
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from exportlm.errors import ExportLMError

__all__ = ["main"]

logger = logging.getLogger("exportlm.cli")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="exportlm",
        description="Export decoder LMs through registered export targets.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (DEBUG)")
    sub = parser.add_subparsers(dest="command", required=True)

    p_list = sub.add_parser(
        "list", help="list targets, runtimes, module exporters and model families"
    )
    p_list.add_argument("--json", action="store_true", help="machine-readable output")

    p_exp = sub.add_parser("export", help="export a model with a target")
    p_exp.add_argument("--target", required=True, help="export target name (see `exportlm list`)")
    p_exp.add_argument(
        "--model",
        required=True,
        help="toy model family (decoder, decoder_tied, iterable_moe, hf:llama, hf:mixtral, ...), "
        "a model structure FILE.json (exportlm.models.ModelSpec) "
        "or a local Hugging Face model directory",
    )
    p_exp.add_argument("--out", required=True, type=Path, help="output file or directory")
    p_exp.add_argument("--seed", type=int, default=0, help="seed of toy model weights (default 0)")
    p_exp.add_argument(
        "--quantize",
        metavar="RECIPE",
        help="fake-quantize first: fp8, nvfp4, int4_awq, int8_wo, optionally +fp8_kv",
    )
    p_exp.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="target option, repeatable (values parsed as Python literals: opset=19, dynamo=False)",
    )
    p_exp.add_argument(
        "--verify",
        action="store_true",
        help="reload the artifact in its runtime and print max abs / rel logits diff",
    )
    return parser


def _parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"exportlm: error: --option expects KEY=VALUE, got {pair!r}")
        try:
            value: Any = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        options[key.strip()] = value
    return options


def load_model_spec(spec: str, seed: int = 0) -> Any:
    """Build the model named by a CLI ``--model`` spec.

    ``hf:FAMILY`` and registered family names build seeded toy models (no
    download); a path ending in ``.json`` holds a model structure
    (:class:`exportlm.models.ModelSpec`, as the conformance suite's
    ``roundtrip_generated`` writes it) built by
    :func:`exportlm.models.build_from_spec`; an existing directory loads a local
    Hugging Face checkpoint with ``local_files_only=True``.

    An unreadable or invalid ``.json`` file raises
    :class:`~exportlm.errors.InvalidConfigError` naming the file and what is wrong.
    """
    from exportlm.models import build_model, ensure_models_registered, model_names

    path = Path(spec)
    if path.suffix.lower() == ".json" and not path.is_dir():
        return _model_from_json(path, seed)
    if path.is_dir():
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    name = spec.removeprefix("hf:")
    ensure_models_registered()
    if name not in model_names() and spec.startswith("hf:"):
        name = spec  # let the registry report it with the available names
    return build_model(name, seed=seed)


def _model_from_json(path: Path, seed: int) -> Any:
    """The model of the :class:`~exportlm.models.ModelSpec` JSON file at ``path``."""
    from exportlm.errors import InvalidConfigError
    from exportlm.models import build_from_spec

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise InvalidConfigError(f"--model {path}: cannot read the model spec file: {err}") from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidConfigError(
            f"--model {path}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); "
            "expected a model spec object as written by ModelSpec.to_json()"
        ) from err
    try:
        return build_from_spec(data, seed=seed)
    except ExportLMError as err:
        raise InvalidConfigError(f"--model {path}: {err}") from err


def _cmd_list(as_json: bool) -> int:
    from exportlm.export import (
        EXPORT_REGISTRY,
        RUNTIME_REGISTRY,
        ensure_exporters_registered,
        get_target_info,
    )

    ensure_exporters_registered()
    targets: list[dict[str, Any]] = []
    for entry in EXPORT_REGISTRY.entries():
        info = get_target_info(entry.name)
        targets.append(
            {
                "name": entry.name,
                "provider": entry.provider,
                "runtime": info.runtime,
                "runtime_available": info.runtime in RUNTIME_REGISTRY,
                "artifact": info.artifact,
                "capabilities": sorted(info.capabilities),
                "atol": info.atol,
                "rtol": info.rtol,
                "variants": sorted(info.variants),
                "description": info.description,
            }
        )
    runtimes = [{"name": e.name, "provider": e.provider} for e in RUNTIME_REGISTRY.entries()]
    exporters = _module_exporters()
    models = _model_families()
    failed = [
        {"registry": reg.kind, "error": str(err)}
        for reg in (EXPORT_REGISTRY, RUNTIME_REGISTRY)
        for err in reg.plugin_errors
    ]
    if as_json:
        print(
            json.dumps(
                {
                    "targets": targets,
                    "runtimes": runtimes,
                    "module_exporters": exporters,
                    "models": models,
                    "failed_plugins": failed,
                },
                indent=2,
            )
        )
        return 0
    print("Export targets:")
    rows: list[tuple[str, ...]] = [
        (
            t["name"],
            t["runtime"] + ("" if t["runtime_available"] else " (missing!)"),
            t["artifact"],
            ",".join(t["capabilities"]) or "-",
            f"atol={t['atol']:g} rtol={t['rtol']:g}",
            t["provider"],
        )
        for t in targets
    ]
    _table(("name", "runtime", "artifact", "capabilities", "tolerance", "provided by"), rows)
    print("\nRuntimes:")
    _table(("name", "provided by"), [(r["name"], r["provider"]) for r in runtimes])
    if exporters:
        print("\nModule exporters (match order):")
        _table(
            ("name", "keys", "provided by"),
            [(e["name"], e["keys"], e["provider"]) for e in exporters],
        )
    if models:
        print("\nModel families:")
        _table(("name", "provided by"), [(m["name"], m["provider"]) for m in models])
    if failed:
        print("\nPlugins that failed to load:")
        for f in failed:
            print(f"  {f['registry']}: {f['error']}")
    return 0


def _module_exporters() -> list[dict[str, str]]:
    try:
        from exportlm import modules
    except ImportError:  # pragma: no cover - partial install
        return []
    modules.ensure_module_exporters_registered()
    providers = {e.name: e.provider for e in modules.MODULE_EXPORTER_REGISTRY.entries()}
    rows = []
    for entry in modules.EXPORT_MODULE_REGISTRY.entries():  # match order: first match wins
        name = getattr(entry.exporter, "name", type(entry.exporter).__name__)
        keys = ", ".join(k if isinstance(k, str) else k.__name__ for k in entry.keys)
        if entry.predicate is not None:
            keys = f"{keys} + predicate" if keys else "predicate"
        rows.append(
            {"name": name, "keys": keys, "provider": providers.get(name, "registered in code")}
        )
    return rows


def _model_families() -> list[dict[str, str]]:
    try:
        from exportlm.models import MODEL_REGISTRY, ensure_models_registered
    except ImportError:  # pragma: no cover - partial install
        return []
    ensure_models_registered()
    return [{"name": e.name, "provider": e.provider} for e in MODEL_REGISTRY.entries()]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    for row in (header, *rows):
        print("  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


def _cmd_export(args: argparse.Namespace) -> int:
    import torch

    from exportlm.export import (
        ExportCacheWrapper,
        compare_logits,
        export_model,
        get_target_info,
        infer_vocab_size,
        load_exported,
        make_input_ids,
    )

    options = _parse_options(args.option)
    model = load_model_spec(args.model, seed=args.seed)
    if args.quantize:
        from exportlm.quant import quantize

        model = quantize(model, args.quantize)
    start = time.perf_counter()
    path = export_model(args.target, model, args.out, **options)
    elapsed = time.perf_counter() - start
    size = sum(
        p.stat().st_size for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file()
    )
    print(
        f"exported {args.model} with {args.target} -> {path} ({size / 1e6:.2f} MB, {elapsed:.2f} s)"
    )
    if not args.verify:
        return 0
    info = get_target_info(args.target)
    ids = make_input_ids(infer_vocab_size(model), batch=2, seq=8, seed=1)
    with torch.no_grad():
        # The same eager view every target exports: use_cache=False, logits only.
        expected = ExportCacheWrapper(model).eval()(ids).float()
        actual = torch.as_tensor(load_exported(args.target, path)(ids)).float()
    comparison = compare_logits(actual, expected, info.atol, info.rtol)
    print(f"verify: {comparison.summary()}: {'OK' if comparison.passed else 'MISMATCH'}")
    return 0 if comparison.passed else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``exportlm`` console script."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "list":
            return _cmd_list(args.json)
        return _cmd_export(args)
    except (ExportLMError, TypeError, ValueError) as err:
        if args.verbose:
            logger.exception("exportlm failed")
        print(f"exportlm: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
