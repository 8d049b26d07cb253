"""Keep a test module on one xdist worker when its module-scoped fixture is costly.

``make test`` runs ``--dist loadgroup``: a test without an ``xdist_group`` mark is a
unit of work of its own, so the tests of one module spread over every worker and each
worker builds the module's fixtures again (for an export fixture: the same ONNX or
``torch.export`` exports, seconds each, once per worker). A module whose fixture costs
more than the parallelism it loses marks itself ``pytestmark = one_worker(__name__)``;
modules that share one per-process memo (the quantization survey of
``tests._services.SERVICES``, ~4.5 s CPU per process) share one group name instead.
"""

from __future__ import annotations

import pytest

__all__ = ["SURVEY", "one_worker"]


#: The group of the modules whose checks share the survey of ``tests._services.SERVICES``.
SURVEY = "services-survey"


def one_worker(group: str) -> pytest.MarkDecorator:
    """The ``xdist_group`` mark that runs every test marked with ``group`` on one worker."""
    return pytest.mark.xdist_group(f"one-worker:{group}")
