"""Coverage in the verdict: which checks are value checks and the unchecked rows
(``_coverage``), ``--export-strict`` / ``--export-lock`` / ``--export-shard`` judged
(``_verdict``) and the lockfile ``exportcheck.lock`` (``_lock``).
"""
