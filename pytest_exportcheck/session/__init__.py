"""The pytest layer: the session registered as a plugin, grouped by concern.

:class:`ExportCheckSession` (``_session``) is the run's state and its hooks (methods);
the nodes (``exportcheck`` > check > item, :mod:`.nodes`) hand items to the runner
(``_item_runner``), which runs them through :func:`pytest_exportcheck.run.run_item`.
Beside them: the options (:mod:`.options`), coverage in the verdict (:mod:`.coverage`),
what a run reports (:mod:`.reporting`) and what it sets up around its items
(:mod:`.environment`). Importing this package imports
nothing heavy; :mod:`._session` (imported by ``plugin.py`` once the suite is
requested) imports exportlm and through it torch.
"""
