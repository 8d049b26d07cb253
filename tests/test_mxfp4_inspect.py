"""``exportlm inspect`` on gpt-oss's MXFP4 layout (``quant_method: "mxfp4"``): what its loaders
quantize by ``modules_to_not_convert`` against what the tensors store.

transformers leaves a module float when a ``modules_to_not_convert`` entry matches it (a regular
expression, ``re.match``, or a suffix) and reads ``<p>_blocks`` / ``<p>_scales`` of experts
modules only; vLLM reads no ``modules_to_not_convert`` and quantizes every experts module. Each
contradiction is planted in a copy of a toy export (the config or one tensor edited, as another
tool would write it) and named by its rule; our export and openai's published config pass.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from exportlm.inspection import RULES, Severity, inspect_checkpoint
from exportlm.models import tiny_hf_model
from tests.test_mxfp4_native import LAYERS, MANIFEST, OPENAI, _export

RULE_IDS = (
    "mxfp4-blocks-outside-experts",
    "mxfp4-float-experts",
    "mxfp4-float-experts-listed",
    "mxfp4-excluded-but-quantized",
)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _export(tmp_path_factory.mktemp("mxfp4"))


@pytest.fixture
def out(exported: Path, tmp_path: Path) -> Path:
    """A copy of the toy export, without its manifest (edited as another tool's checkpoint)."""
    copy = Path(shutil.copytree(exported, tmp_path / "copy"))
    (copy / MANIFEST).unlink()
    return copy


def _set_not_converted(out: Path, value: Any) -> None:
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = value
    (out / "config.json").write_text(json.dumps(config))


def _not_converted(out: Path) -> list[str]:
    section = json.loads((out / "config.json").read_text())["quantization_config"]
    names: list[str] = section["modules_to_not_convert"]
    return names


def _found(out: Path) -> list[tuple[str, str, str]]:
    """``(rule, severity, subject)`` of the report's mxfp4 and config-field findings."""
    report = inspect_checkpoint(out)
    keep = (*RULE_IDS, "config-field-invalid")
    return [(f.rule, f.severity.value, f.subject) for f in report.findings if f.rule in keep]


def _float_experts(out: Path, layer: str) -> None:
    """The experts of ``layer`` stored in float as transformers' GptOssExperts holds them."""
    from safetensors.torch import load_file, save_file

    state = tiny_hf_model("gpt_oss", seed=0).eval().state_dict()
    shard = next(out.glob("*.safetensors"))
    tensors = load_file(shard)
    for projection in ("gate_up_proj", "down_proj"):
        for leaf in ("blocks", "scales"):
            del tensors[f"{layer}.{projection}_{leaf}"]
        tensors[f"{layer}.{projection}"] = state[f"{layer}.{projection}"].contiguous()
    save_file(tensors, shard, metadata={"format": "pt"})


def test_our_export_and_openais_published_config_pass(out: Path) -> None:
    assert inspect_checkpoint(out).errors == []
    assert _found(out) == []
    _set_not_converted(out, OPENAI["modules_to_not_convert"])
    assert inspect_checkpoint(out).errors == []
    assert _found(out) == []


def test_the_rules_are_documented_with_their_severity() -> None:
    severities = {rule: RULES[rule].severity for rule in RULE_IDS}
    assert severities == {
        "mxfp4-blocks-outside-experts": Severity.ERROR,
        "mxfp4-float-experts": Severity.ERROR,
        "mxfp4-float-experts-listed": Severity.WARNING,
        "mxfp4-excluded-but-quantized": Severity.WARNING,
    }


@pytest.mark.parametrize(
    "entry",
    [
        LAYERS[0],  # the module itself
        "model.layers.0.mlp",  # a module above it (transformers: re.match(entry + "\\."))
        "model.layers.*.mlp.experts",  # a wildcard, as openai writes them
        "experts",  # a suffix (transformers: full_name.endswith(entry))
    ],
)
def test_a_listed_module_storing_blocks_is_a_transformers_warning(out: Path, entry: str) -> None:
    _set_not_converted(out, [*_not_converted(out), entry])
    blocks = f"{LAYERS[0]}.down_proj_blocks"
    found = _found(out)
    assert ("mxfp4-excluded-but-quantized", "warning", blocks) in found
    assert {rule for rule, _, _ in found} == {"mxfp4-excluded-but-quantized"}
    finding = next(f for f in inspect_checkpoint(out).findings if f.subject == blocks)
    assert finding.details["entry"] == entry
    assert "vLLM reads no modules_to_not_convert and loads the blocks" in finding.message
    assert "transformers' MXFP4 kernel load (GPU)" in finding.message


def test_an_entry_that_only_looks_like_a_prefix_covers_nothing(out: Path) -> None:
    """``model.layers.1`` matches ``model.layers.1.mlp.experts`` (and ``model.layers.10``, as
    re.match would), ``model.layers.1.mlp.experts.x`` matches nothing stored."""
    _set_not_converted(out, [*_not_converted(out), "model.layers.0.mlp.experts.gate_up_proj"])
    assert _found(out) == []
    _set_not_converted(out, ["model.layers.1"])
    assert _found(out) == [
        ("mxfp4-excluded-but-quantized", "warning", f"{LAYERS[1]}.down_proj_blocks")
    ]


def test_float_experts_no_entry_covers_are_an_error(out: Path) -> None:
    _float_experts(out, LAYERS[1])
    report = inspect_checkpoint(out)
    assert [(f.rule, f.subject) for f in report.errors] == [
        ("mxfp4-float-experts", f"{LAYERS[1]}.down_proj"),
        ("mxfp4-float-experts", f"{LAYERS[1]}.gate_up_proj"),
    ]
    assert "it maps" in report.errors[0].message
    assert "w13_weight / w2_weight" in report.errors[0].message


def test_float_experts_an_entry_covers_are_a_vllm_warning(out: Path) -> None:
    _float_experts(out, LAYERS[1])
    _set_not_converted(out, [*_not_converted(out), "model.layers.*.mlp.experts"])
    found = _found(out)
    assert ("mxfp4-float-experts-listed", "warning", f"{LAYERS[1]}.gate_up_proj") in found
    # layer 0 still stores blocks, and the wildcard covers it too
    assert ("mxfp4-excluded-but-quantized", "warning", f"{LAYERS[0]}.down_proj_blocks") in found
    assert inspect_checkpoint(out).errors == []


@pytest.mark.parametrize("module", ["model.layers.0.self_attn", "model.layers.0.mlp"])
def test_blocks_outside_an_experts_module_are_an_error(out: Path, module: str) -> None:
    """A projection's tensors renamed under another module: every loader fails or misreads it
    (ours: ``test_blocks_under_a_module_that_is_no_experts_are_refused``)."""
    edits = {
        f"{LAYERS[0]}.gate_up_proj_{leaf}": f"{module}.gate_up_proj_{leaf}"
        for leaf in ("blocks", "scales")
    }
    _rename(out, edits)
    errors = [f for f in inspect_checkpoint(out).errors if f.rule in RULE_IDS]
    assert [(f.rule, f.subject) for f in errors] == [
        ("mxfp4-blocks-outside-experts", f"{module}.gate_up_proj_blocks")
    ]
    assert "exportlm's loader refuses the checkpoint" in errors[0].message


def _rename(out: Path, names: dict[str, str]) -> None:
    from safetensors.torch import load_file, save_file

    shard = next(out.glob("*.safetensors"))
    tensors = load_file(shard)
    for old, new in names.items():
        tensors[new] = tensors.pop(old)
    save_file(tensors, shard, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("lm_head", "expected a list of module names"),
        (["lm_head", 3], "expected a list of module names"),
        (["model.layers.[0"], "is no regular expression"),
        (["(" * 2000 + "x" + ")" * 2000], "is no regular expression"),  # re: RecursionError
    ],
)
def test_a_field_transformers_cannot_match_is_invalid(out: Path, value: Any, why: str) -> None:
    _set_not_converted(out, value)
    errors = [f for f in inspect_checkpoint(out).errors if f.rule == "config-field-invalid"]
    assert [f.subject for f in errors] == ["config.json: modules_to_not_convert"]
    assert why in errors[0].message


#: (entry with groups / alternation, the experts layers it covers). Before: such an entry was
#: skipped, as if it covered nothing.
GROUPED = [
    ("model.layers.(0|1).mlp.experts", (0, 1)),
    ("model.layers.(?:1|2).mlp.experts", (1,)),
    (r"model\.layers\.[0-9]+\.mlp\.(experts|router)", (0, 1)),
    (r"(model|transformer)\.layers\.0", (0,)),
    (r"(?P<layer>model\.layers\.(1|10))\.mlp\.experts$", (1,)),
    ("(.*layers.)+(?:0|9).mlp", (0,)),
    ("model.layers.(0|1).self_attn", ()),
    (r"model\.layers\.\d{2}", ()),
]


@pytest.mark.parametrize(("entry", "layers"), GROUPED)
def test_an_entry_with_groups_covers_what_transformers_matches(
    out: Path, entry: str, layers: tuple[int, ...]
) -> None:
    """The experts modules covered are those transformers' own ``should_convert_module``
    (``re.match``) keeps float."""
    utils = pytest.importorskip("transformers.quantizers.quantizers_utils")
    kept = [i for i, m in enumerate(LAYERS) if not utils.should_convert_module(m, [entry])]
    assert tuple(kept) == layers
    _set_not_converted(out, [entry])
    warned = [f"{LAYERS[i]}.down_proj_blocks" for i in layers]
    assert _found(out) == [("mxfp4-excluded-but-quantized", "warning", s) for s in warned]


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        (r"(model)\.layers\.\1", "a backreference"),
        ("model.layers.0.mlp.experts(?=$)", "a lookahead / lookbehind"),
        ("(?i)MODEL.layers.1", "inline flags"),
        ("model.layers.1" + ".?" * 600, "more than 1000 automaton states"),
    ],
)
def test_an_entry_not_matched_without_backtracking_is_reported(
    out: Path, entry: str, why: str
) -> None:
    """Before: skipped silently, as if it covered nothing; now the user is told."""
    _set_not_converted(out, [entry])
    report = inspect_checkpoint(out)
    found = [f for f in report.findings if f.rule == "mxfp4-entry-not-evaluated"]
    assert [(f.severity.value, f.subject, f.details["entry"]) for f in found] == [
        ("warning", "config.json: modules_to_not_convert", entry)
    ]
    assert why in found[0].details["why"]
    assert "transformers' should_convert_module matches it with re.match" in found[0].message
    assert report.errors == []


def test_a_pattern_built_to_backtrack_does_not_hang(out: Path) -> None:
    """``re.match("a*" * 12 + "b", "a" * 40 + ...)`` backtracks for minutes (measured: 1.3 s at
    8 stars, past 20 s at 10), and so do ``(a+)+b`` and ``(a|aa)*b``; the entries are matched
    as a set of automaton states, in time linear in the name and the entry's states, groups
    included, and an entry past the state limit is reported, not run."""
    experts = "a" * 40 + ".mlp.experts"
    _rename(
        out,
        {
            f"{LAYERS[0]}.{p}_{leaf}": f"{experts}.{p}_{leaf}"
            for p in ("gate_up_proj", "down_proj")
            for leaf in ("blocks", "scales", "bias")
        },
    )
    _set_not_converted(out, ["a*" * 12 + "b", "(a+)+b", "(a|aa)*b", ".*" * 2000 + "!"])
    code = "from exportlm.inspection import inspect_checkpoint as i; import sys; i(sys.argv[1])"
    done = subprocess.run([sys.executable, "-c", code, str(out)], timeout=120, check=False)
    assert done.returncode == 0
    started = time.monotonic()
    report = inspect_checkpoint(out)
    assert time.monotonic() - started < 10  # measured 0.06 s at load 6 (re: minutes)
    skipped = [f.details["entry"] for f in report.findings if f.rule == "mxfp4-entry-not-evaluated"]
    assert skipped == [".*" * 2000 + "!"]  # over the state limit; the groups are run
    for entry in ("a*" * 12 + ".", "(a|aa)*\\.mlp"):  # the same matcher: they cover the module
        _set_not_converted(out, [entry])
        blocks = f"{experts}.down_proj_blocks"
        assert ("mxfp4-excluded-but-quantized", "warning", blocks) in _found(out)
