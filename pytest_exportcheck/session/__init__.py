"""The pytest layer: the session registered as a plugin, nodes, options, report, header, JUnit.

:class:`ExportCheckSession` is the run's state and its hooks (methods); the
nodes (``exportcheck`` > check > item) hand items to the runner, which runs them
through :func:`pytest_exportcheck.run.run_item`. Importing this package imports
nothing heavy; :mod:`._session` (imported by ``plugin.py`` once the suite is
requested) imports exportlm and through it torch.
"""
