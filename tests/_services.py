"""The :class:`CheckServices` the direct check tests of one process share.

The plugin gives every case of a pytest process one services object, so a survey
(and each quantized toy model in it) is computed once per process and registry
state; the tests that call checks directly do the same through this one.
"""

from __future__ import annotations

from pytest_exportcheck.checks._services import CheckServices

__all__ = ["SERVICES"]

SERVICES = CheckServices()
