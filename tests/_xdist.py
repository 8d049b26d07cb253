"""Keep a test module on one xdist worker when its module-scoped fixture is costly.

``make test`` runs ``--dist loadgroup``: a test without an ``xdist_group`` mark is a
unit of work of its own, so the tests of one module spread over every worker and each
worker builds the module's fixtures again (for an export fixture: the same ONNX or
``torch.export`` exports, seconds each, once per worker). A module whose fixture costs
more than the parallelism it loses marks itself ``pytestmark = one_worker(__name__)``.
"""

from __future__ import annotations

import pytest

__all__ = ["one_worker"]


def one_worker(module: str) -> pytest.MarkDecorator:
    """The ``xdist_group`` mark that runs every test of ``module`` on one worker."""
    return pytest.mark.xdist_group(f"module:{module}")
