"""The ``exportlm`` command line: ``list``, ``export`` and ``env``.

One concern per module: ``_parser`` (arguments), ``_logging`` (what goes to
stderr, by ``-v`` / ``-q``), ``_errors`` (exit codes), ``_options`` (``-o``
values), ``_model`` (the ``--model`` argument), ``_calib`` (``--quantize`` and
``--calib-*``), ``_export``, ``_list``, ``_env`` (the subcommands) and
``_inventory`` (what is registered).
"""

from exportlm.cli._errors import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, UsageError
from exportlm.cli._main import main
from exportlm.cli._model import load_model_spec

__all__ = ["EXIT_FAILURE", "EXIT_OK", "EXIT_USAGE", "UsageError", "load_model_spec", "main"]
