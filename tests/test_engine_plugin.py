"""A third-party engine plugin is first-class: its record's tolerance is the one ``served`` uses.

The plugin (``tests/_engine_plugin.py``) is a distribution with an ``exportlm.engines``
entry point whose worker computes logits with transformers in its own process. Through
the pytest plugin (pytester, in-process runs), it passes ``served`` on the built-in
``hf_checkpoint`` artifact with no patching of the library, and fails it when its worker
drops the attention mask.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests._engine_plugin import ENGINE, make_engine_plugin
from tests._installed import runpytest_installed

BASE = [
    "--export-only",
    "-p",
    "no:cacheprovider",
    "-n",
    "0",
    "--export-checks=served",
    "--export-targets=hf_checkpoint",
    "--export-models=llama",
    "-v",
    "-k",
    "toy",
]
ITEM = f"served[hf_checkpoint-{ENGINE}-llama-cpu]"


def test_a_third_party_engine_with_a_tolerance_on_its_record_passes_served(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    plugin = make_engine_plugin(tmp_path / "site")
    result = runpytest_installed(pytester, plugin, *BASE)
    result.stdout.re_match_lines([rf".*{re.escape(ITEM)} PASSED"])
    result.assert_outcomes(passed=1)


def test_its_worker_dropping_the_attention_mask_fails_served(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    plugin = make_engine_plugin(tmp_path / "site", drop_mask=True)
    result = runpytest_installed(pytester, plugin, *BASE, "-rf")
    result.stdout.re_match_lines(
        [rf".*{re.escape(ITEM)} FAILED", rf".*\[{ENGINE} / plain / failed\] .*logprob"]
    )
    result.assert_outcomes(failed=1)
