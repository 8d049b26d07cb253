"""The ``--export-*`` options: the one table of them (``_option_specs``), how
they are registered and read back (``_options``: :class:`Options`), the parsers of
their values (``_option_values``), the paths they name (``_option_paths``) and the
coverage options (``_coverage_options``).
"""
