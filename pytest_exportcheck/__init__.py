"""pytest-exportcheck: a conformance suite for llmexport export targets and module exporters."""

__all__ = ["__version__"]

__version__ = "0.1.0"
