"""The markdown tables of ``benchmarks/quality.py --markdown RESULTS`` (docs/quality.md)."""

from __future__ import annotations

from typing import Any

NAMES = {"exportlm": "exportlm", "modelopt": "ModelOpt", "llmcompressor": "llm-compressor"}
DASH = "—"


def _num(value: float | None, fmt: str) -> str:
    return DASH if value is None else format(value, fmt)


def _metric(row: dict[str, Any], where: str, key: str, fmt: str) -> str:
    found = row.get(where)
    if found:
        return format(found[key], fmt)
    error = row.get(f"{where}_error")
    return f"error: {error[:60]}" if error else DASH


def _quality_row(row: dict[str, Any]) -> list[str]:
    name = NAMES.get(row["producer"], row["producer"])
    if row.get("absent"):
        return [row["recipe"], name, DASH, DASH, DASH, DASH, DASH, DASH]
    if "error" in row and not row.get("mem") and not row.get("ckpt"):
        message = row["error"].replace("|", "/")[:120]
        return [row["recipe"], name, f"error: {message}", DASH, DASH, DASH, DASH, DASH]
    return [
        row["recipe"],
        name,
        _metric(row, "mem", "ppl", ".3f"),
        _metric(row, "ckpt", "ppl", ".3f"),
        _metric(row, "mem", "agree", ".3f"),
        _metric(row, "ckpt", "agree", ".3f"),
        _num(row.get("export_s"), ".0f"),
        _num(row["peak_rss"] / 1e9 if "peak_rss" in row else None, ".2f"),
    ]


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _measured(row: dict[str, Any]) -> tuple[float, str] | None:
    """A row's perplexity for the verdict: its in-memory model, else its checkpoint in our
    runtime (ours under ``--no-ours-memory``; a peer whose fake quantization fails on this
    CPU, e.g. ModelOpt's MX kernels, but whose checkpoint was written)."""
    if row.get("mem"):
        return row["mem"]["ppl"], ""
    if row.get("ckpt") and (row["producer"] == "exportlm" or row.get("mem_error")):
        return row["ckpt"]["ppl"], " (its checkpoint)" if row["producer"] != "exportlm" else ""
    return None


def verdicts(results: dict[str, Any]) -> list[str]:
    """Per recipe: our perplexity against the better peer's (the 1% rule)."""
    out = []
    by_recipe: dict[str, dict[str, tuple[float, str]]] = {}
    for row in results["rows"]:
        found = None if row.get("memory_row") else _measured(row)
        if found:
            by_recipe.setdefault(row["recipe"], {})[row["producer"]] = found
    for recipe, ppl in by_recipe.items():
        peers = {k: v for k, v in ppl.items() if k != "exportlm"}
        if "exportlm" not in ppl or not peers:
            continue
        best = min(peers, key=lambda k: peers[k][0])
        ours, (theirs, how) = ppl["exportlm"][0], peers[best]
        excess = ours / theirs - 1
        mark = "within 1%" if excess <= 0.01 else "WORSE by more than 1%"
        out.append(
            f"- `{recipe}`: exportlm {ours:.3f}, better peer {NAMES[best]}{how} "
            f"{theirs:.3f} ({excess:+.1%}): {mark}"
            f"{'' if how else _deployed(results, recipe)}"
        )
    return out


def _deployed(results: dict[str, Any], recipe: str) -> str:
    """Ours against ModelOpt's *checkpoint*, both read by the same runtime: what is deployed,
    where a producer's in-memory model holds what its export cannot (ModelOpt's AWQ keeps
    one pre-quantization scale per linear in memory and averages those of q/k/v at export)."""
    ckpt = {
        r["producer"]: r["ckpt"]["ppl"]
        for r in results["rows"]
        if r["recipe"] == recipe and not r.get("memory_row") and r.get("ckpt")
    }
    if "exportlm" not in ckpt or "modelopt" not in ckpt:
        return ""
    ours, theirs = ckpt["exportlm"], ckpt["modelopt"]
    return f"; checkpoints: ours {ours:.3f}, ModelOpt's {theirs:.3f} ({ours / theirs - 1:+.1%})"


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    bf16 = meta["bf16"]
    header = ["recipe", "producer", "ppl (memory)", "ppl (checkpoint)", "agree (memory)",
              "agree (checkpoint)", "export s", "peak RSS GB"]  # fmt: skip
    rows = []
    if bf16:
        rows.append(["bf16", "(no quantization)", f"{bf16['ppl']:.3f}", DASH,
                     f"{bf16['agree']:.3f}", DASH, DASH, DASH])  # fmt: skip
    rows += [_quality_row(r) for r in results["rows"] if not r.get("memory_row")]
    calib = meta["calibration"]
    parts = (
        []
        if not bf16
        else [
            f"Calibration: {calib['rows']} rows x {meta['seq_len']} tokens ({calib['tokens']} "
            f"tokens); perplexity on {meta['eval_tokens']} tokens; run started {meta['started']}, "
            f"{meta['wall_s'] / 60:.0f} min wall."
            + (
                " Every calibration and evaluation in float32 matmuls (`--float32-matmuls`)."
                if meta.get("float32_matmuls")
                else ""
            ),
            "",
            _table(header, rows),
        ]
    )
    memory = [r for r in results["rows"] if r.get("memory_row")]
    if memory:
        parts += [
            "",
            f"FP8 export at {meta['memory_samples']} x {meta['memory_seq_len']} calibration "
            "tokens (export only):",
            "",
            _table(
                ["producer", "export s", "peak RSS GB", "note"],
                [
                    [
                        NAMES.get(r["producer"], r["producer"]),
                        _num(r.get("export_s"), ".0f"),
                        _num(r["peak_rss"] / 1e9 if "peak_rss" in r else None, ".2f"),
                        r.get("error", "").replace("|", "/")[:120],
                    ]
                    for r in memory
                ],
            ),
        ]
    peaks = {r["producer"]: r["peak_rss"] for r in memory if "peak_rss" in r}
    if "exportlm" in peaks and "modelopt" in peaks:
        parts += [
            "",
            f"exportlm's peak RSS / ModelOpt's: {peaks['exportlm'] / peaks['modelopt']:.2f}",
        ]
    found = verdicts(results)
    if found:
        parts += [
            "",
            "Perplexity, ours (in memory, else its checkpoint) against the better peer (in "
            "memory, else its checkpoint where its in-memory model failed):",
            "",
            *found,
        ]
    return "\n".join(parts)
