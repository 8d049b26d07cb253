"""Names the checks and the run share without importing the package face: Hypothesis profiles.

A leaf (standard library only): ``pytest_exportcheck.HYPOTHESIS_PROFILE`` re-exports it.
"""

from __future__ import annotations

__all__ = ["HYPOTHESIS_PROFILE"]

#: The Hypothesis profiles exportcheck items run under unless the user chose a profile
#: (``--hypothesis-profile``): ``"ci"`` (derandomized) when the ``CI`` environment
#: variable is set, else ``"dev"``. Both have ``deadline=None``, a fixed
#: ``max_examples`` and ``database=None`` (no ``.hypothesis/`` directory).
HYPOTHESIS_PROFILE = {"dev": "exportcheck-dev", "ci": "exportcheck-ci"}
