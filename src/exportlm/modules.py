"""Deprecated alias of :mod:`exportlm.module_exporters` (the room's name until 0.1).

``import exportlm.modules`` still works and warns; import from
``exportlm.module_exporters`` instead. This alias will be removed in 0.3.
"""

from __future__ import annotations

import warnings

from exportlm.module_exporters import *  # noqa: F403
from exportlm.module_exporters import __all__ as __all__

warnings.warn(
    "exportlm.modules was renamed exportlm.module_exporters; import from there "
    "(the old name is removed in 0.3)",
    DeprecationWarning,
    stacklevel=2,
)
