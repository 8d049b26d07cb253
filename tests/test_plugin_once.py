"""One cache key per export, a target's ``accepts`` once per item (issue 40).

Through the public plugin: a target plugin (a conftest registering it in code, as
docs/plugin-authors.md allows) logs each call of its ``accepts`` and of its export
factory; a run with the cross-run artifact cache (where failed exports are remembered
under the same key) then shows how often each ran. Before, the runner's gate and the
check that built the model each asked ``accepts``, and the failure memo and the cache
each computed the key (a fingerprint of the model's weights) of one export.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

# In-process pytester runs drop the modules they imported when they end; import
# what the suite loads once here, so those runs reuse it (and its registries).
import exportlm.export
import exportlm.models  # noqa: F401
import pytest_exportcheck.checks  # noqa: F401
from pytest_exportcheck.run._cache import ArtifactCache

COUNTED_TARGET = """
from pathlib import Path

from exportlm.export import (
    EXPORT_REGISTRY, RUNTIME_REGISTRY, ensure_exporters_registered, export_target,
)

ensure_exporters_registered()
_TORCHSCRIPT = EXPORT_REGISTRY.get("torchscript")
LOG = Path(__file__).with_name("calls.log")


def _log(what):
    with LOG.open("a", encoding="utf-8") as out:
        out.write(what + "\\n")


def accepts(model):
    _log("accepts")
    return None


@export_target("counted", suffix=".pt", accepts=accepts, executes_code=True)
def counted(model, output_path, **kwargs):
    _log("export")
    return _TORCHSCRIPT(model, output_path, **kwargs)


EXPORT_REGISTRY.register("counted", counted)
RUNTIME_REGISTRY.register("counted", RUNTIME_REGISTRY.get("torchscript"))


def pytest_unconfigure(config):
    EXPORT_REGISTRY.unregister("counted")
    RUNTIME_REGISTRY.unregister("counted")
"""

FAMILIES = ("decoder", "llama")
ARGS = [
    "--export-targets=counted",
    f"--export-models={','.join(FAMILIES)}",
    "--export-checks=roundtrip_logits,artifact_contract",
    "--export-report=report.json",
    "-p",
    "no:randomly",
]


def test_accepts_once_per_item_and_one_cache_key_per_export(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = Counter[str]()
    real_key = ArtifactCache.key

    def counting_key(self: ArtifactCache, *args: Any, **kwargs: Any) -> str:
        key: str = real_key(self, *args, **kwargs)
        keys[key] += 1
        return key

    monkeypatch.setattr(ArtifactCache, "key", counting_key)
    pytester.makeconftest(COUNTED_TARGET)
    result = pytester.runpytest_inprocess(*ARGS)
    result.assert_outcomes(passed=2 * len(FAMILIES))
    calls = Counter((pytester.path / "calls.log").read_text().split())
    items = json.loads((pytester.path / "report.json").read_text())["items"]
    asked = sum(
        i["profile"].get("cache_hits", 0) + i["profile"].get("cache_misses", 0) for i in items
    )
    # accepts: once per (target, family) in the process, plus the one export_model makes
    # per export; the items (2 per family) add none.
    assert calls["accepts"] == len(FAMILIES) + calls["export"], calls
    assert calls["export"] >= len(FAMILIES)
    # the cache key: once per export the checks asked the cache for, not twice
    assert sum(keys.values()) == asked, (keys, asked)
