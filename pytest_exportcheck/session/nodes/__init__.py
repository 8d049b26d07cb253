"""The suite's pytest nodes: collectors and items (``_nodes``), their markers
(``_markers``), the xdist scheduling of items that share an artifact (``_xdist``) and
the suite items a bare ``--lf`` replans (``_rerun``).
"""
