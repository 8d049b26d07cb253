"""Shared test setup: quiet, offline, one torch thread per xdist worker."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config: object) -> None:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
