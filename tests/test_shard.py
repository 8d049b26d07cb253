"""``--export-shard=K/N``: the pure split of planned items into shards (plan/_shard.py)."""

from __future__ import annotations

import random

import pytest

from pytest_exportcheck.checks import CHECKS
from pytest_exportcheck.plan import ItemSpec
from pytest_exportcheck.plan._shard import Shard, assign, group_of, in_shard

TARGETS = ("onnx", "torch_export", "torchscript:script", "torchscript:trace")
MODELS = ("llama", "mixtral", "qwen2", "gpt_oss", "dbrx")


def _specs() -> list[ItemSpec]:
    specs: list[ItemSpec] = []
    for column in TARGETS:
        target = column.split(":")[0]
        for check in ("registered", "deterministic", "roundtrip_generated"):
            cost = CHECKS[check].cost
            specs.append(
                ItemSpec(check, "target", column, (column, "cpu"), target=target, cost=cost)
            )
        for model in MODELS:
            for check in ("roundtrip_logits", "dynamic_shapes", "generation_parity"):
                specs.append(
                    ItemSpec(
                        check,
                        "target",
                        column,
                        (column, model, "cpu"),
                        target=target,
                        model=model,
                        cost=CHECKS[check].cost,
                    )
                )
    for exporter in ("fp8", "nvfp4", "int4_awq"):
        for check in ("mro_match", "golden_checkpoint", "quantized_generated"):
            cost = CHECKS[check].cost
            specs.append(
                ItemSpec(check, "exporter", exporter, (exporter,), exporter=exporter, cost=cost)
            )
    return specs


@pytest.mark.parametrize("text", ["0/2", "3/2", "x", "1/0", "", "1/", "/2", "1/2/3", "-1/2"])
def test_a_bad_shard_is_refused_naming_the_value(text: str) -> None:
    with pytest.raises(ValueError, match=r"--export-shard: expected K/N .*" + repr(text)[1:-1]):
        Shard.parse(text)


def test_a_shard_parses_and_prints_as_given() -> None:
    assert Shard.parse(" 2/3 ") == Shard(2, 3)
    assert str(Shard.parse("1/1")) == "1/1"


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_the_shards_partition_the_items_in_plan_order(count: int) -> None:
    specs = _specs()
    shards = [in_shard(specs, Shard(k, count)) for k in range(1, count + 1)]
    names = [s.name for shard in shards for s in shard]
    assert sorted(names) == sorted(s.name for s in specs)
    assert len(names) == len(set(names))
    for shard in shards:
        positions = [specs.index(s) for s in shard]
        assert positions == sorted(positions)


def test_a_target_and_family_group_stays_in_one_shard() -> None:
    specs = _specs()
    groups = assign(specs, 3)
    for spec in specs:
        shard = groups[group_of(spec)]
        assert spec in in_shard(specs, Shard(shard, 3))
    llama = {groups[group_of(s)] for s in specs if s.column == "onnx" and s.model == "llama"}
    assert len(llama) == 1
    fp8 = {groups[group_of(s)] for s in specs if s.exporter == "fp8"}
    assert len(fp8) == 1


def test_the_split_ignores_the_order_it_is_given() -> None:
    specs = _specs()
    shuffled = list(specs)
    random.Random(4).shuffle(shuffled)
    assert assign(specs, 2) == assign(shuffled, 2)


def test_the_shards_are_balanced_by_the_static_weight() -> None:
    specs = _specs()
    weight = {g: 0 for g in assign(specs, 1)}
    for spec in specs:
        weight[group_of(spec)] += spec.cost
    groups = assign(specs, 2)
    loads = [sum(w for g, w in weight.items() if groups[g] == k) for k in (1, 2)]
    assert abs(loads[0] - loads[1]) <= max(weight.values())


def test_an_item_skipped_at_collection_weighs_nothing() -> None:
    heavy = ItemSpec("roundtrip_generated", "target", "a", ("a", "cpu"), target="a", cost=10)
    skipped = [
        ItemSpec("roundtrip_generated", "target", "b", ("b", "cpu"), target="b", skip="gap"),
        ItemSpec("roundtrip_generated", "target", "c", ("c", "cpu"), target="c", skip="gap"),
    ]
    groups = assign([heavy, *skipped], 2)
    # both weightless groups go to the lighter shard, never next to the heavy one
    assert groups[group_of(heavy)] == 1
    assert {groups[group_of(s)] for s in skipped} == {2}
