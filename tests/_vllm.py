"""The vLLM interpreter the config-parsing tests run their snippets in."""

from __future__ import annotations

import os

import pytest


def vllm_python() -> str:
    """``EXPORTLM_ENGINE_VLLM`` or the one ``make engines`` installed; a skip without one."""
    from exportlm.engines import find_interpreter

    found = os.environ.get("EXPORTLM_ENGINE_VLLM") or find_interpreter("vllm").path
    if not found:
        pytest.skip("no vllm interpreter: run `make engines` (EXPORTLM_ENGINE_VLLM)")
    return str(found)
