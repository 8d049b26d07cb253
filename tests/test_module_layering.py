"""Layering: ``exportlm.module_exporters`` depends on ``exportlm.quant`` only, never on models or export."""

from __future__ import annotations

import json
import os
import subprocess
import sys

#: Run in a fresh interpreter: the test process has imported everything already.
_PROBE = """
import json, sys
from exportlm import module_exporters
module_exporters.ensure_module_exporters_registered()
for exporter in module_exporters.EXPORT_MODULE_REGISTRY.exporters():
    examples = getattr(exporter, "conformance_examples", None)
    if examples is not None:
        examples()
print(json.dumps(sorted(m for m in sys.modules if m.startswith("exportlm."))))
"""


def test_modules_never_import_models_or_export() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "EXPORTLM_DISABLE_PLUGINS": "1"},
    )
    imported = json.loads(result.stdout.strip().splitlines()[-1])
    assert "exportlm.module_exporters" in imported
    assert not [m for m in imported if m.split(".")[1] in ("models", "export")], imported
