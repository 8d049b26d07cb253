"""pytest plugin entry point (``pytest11: exportcheck``). Wires hooks only; no torch import."""
