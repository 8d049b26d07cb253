"""pytest-exportcheck: a conformance suite for exportlm export targets and module exporters.

Installed with exportlm, the pytest plugin ``exportcheck`` is passive until an
``--export-*`` selection (or a node id of the suite) is given: ``pytest
--export-targets=all`` runs every check over every registered export target and
module exporter, and ``pytest "exportcheck::roundtrip_logits[onnx-llama-cpu]"`` reruns
one item. Checks are plain functions in :mod:`pytest_exportcheck.checks`, usable
without pytest.

Importing this package imports neither torch nor exportlm.
"""

from __future__ import annotations

import pytest

from pytest_exportcheck._profiles import HYPOTHESIS_PROFILE
from pytest_exportcheck.api import parametrize_with_checks

__all__ = ["HYPOTHESIS_PROFILE", "ExportCheckWarning", "__version__", "parametrize_with_checks"]

__version__ = "0.1.0"


class ExportCheckWarning(pytest.PytestWarning):
    """An exportcheck configuration problem that does not stop the run.

    For example an expected-failure entry that matches no conformance item.
    """
