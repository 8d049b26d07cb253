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

from pytest_exportcheck._profiles import HYPOTHESIS_PROFILE
from pytest_exportcheck._warnings import ExportCheckWarning
from pytest_exportcheck.api import parametrize_with_checks

__all__ = ["HYPOTHESIS_PROFILE", "ExportCheckWarning", "__version__", "parametrize_with_checks"]

#: The plugin ships in the exportlm distribution: this equals ``exportlm.__version__``
#: (a test holds it), written out so importing the plugin imports no exportlm.
__version__ = "0.1.0"
