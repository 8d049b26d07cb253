"""A minimal third-party exportlm plugin (see ``docs/plugin-authors.md`` of exportlm).

- :func:`~exportlm_plugin_example.target.export_traced`: export target ``example_traced``
  (``torch.jit.trace`` of the logits-only wrapper, saved with ``torch.jit.save``);
- :func:`~exportlm_plugin_example.target.load_traced`: its runtime;
- :class:`~exportlm_plugin_example.exporter.MarkedLinearExporter`: module exporter
  ``example_marked_linear``;
- :data:`~exportlm_plugin_example.models.example_tiny`: toy model family
  ``example_tiny`` (its factory and the failure causes it declares).

Everything is registered through entry points in ``pyproject.toml``; importing this
package registers nothing.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
