"""The version of exportlm: on the floor, so any room may read it without importing the facade."""

__version__ = "0.1.0"
