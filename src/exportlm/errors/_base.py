"""The root of every exportlm error, registries, options, configs and missing packages."""

from __future__ import annotations

__all__ = [
    "ExportLMError",
    "InvalidConfigError",
    "MissingDependencyError",
    "PluginLoadError",
    "RegistryConflictError",
    "RegistryError",
    "UnknownNameError",
    "UnknownOptionError",
]


class ExportLMError(Exception):
    """Base class of every error raised by exportlm."""


class RegistryError(ExportLMError):
    """Base class of registry errors."""


class RegistryConflictError(RegistryError):
    """A different object was registered under a name that is already taken."""

    def __init__(self, kind: str, name: str, existing_owner: str, new_owner: str) -> None:
        self.kind = kind
        self.name = name
        self.existing_owner = existing_owner
        self.new_owner = new_owner
        super().__init__(
            f"{kind} name {name!r} is already registered by {existing_owner}; "
            f"{new_owner} tried to register a different object under the same name. "
            f"Pick another name in {new_owner}, or uninstall one of the two."
        )


class UnknownNameError(RegistryError, ValueError):
    """A name was looked up that no registry entry has."""

    def __init__(
        self, kind: str, name: str, available: list[str], *, detail: str | None = None
    ) -> None:
        self.kind = kind
        self.name = name
        self.available = sorted(available)
        names = ", ".join(self.available) or "(none)"
        if detail is not None:  # the name exists, but not here (e.g. a pinned catalogue)
            super().__init__(f"{detail}; available: {names}")
            return
        super().__init__(
            f"unknown {kind} {name!r}; available: {names}. "
            f"Run `exportlm list` to see every registered name and its provider."
        )


class PluginLoadError(RegistryError):
    """A third-party entry point failed to import or did not validate."""

    def __init__(
        self,
        group: str,
        entry_point: str,
        distribution: str | None,
        cause: BaseException,
        *,
        name: str | None = None,
    ) -> None:
        self.group = group
        self.entry_point = entry_point
        #: The entry point's name (the name it would have been registered under).
        self.name = name or entry_point.split("=", 1)[0].strip()
        self.distribution = distribution or "<unknown distribution>"
        self.cause = cause
        super().__init__(
            f"plugin {entry_point!r} in entry-point group {group!r} "
            f"(distribution {self.distribution}) failed to load: "
            f"{type(cause).__name__}: {cause}. Fix or uninstall that distribution; "
            f"set EXPORTLM_DISABLE_PLUGINS=1 to run without third-party plugins (the built-in targets stay)."
        )


class UnknownOptionError(ExportLMError, TypeError):
    """An export target or runtime was given a keyword argument it does not accept."""

    def __init__(self, where: str, unknown: list[str], accepted: list[str]) -> None:
        self.where = where
        self.unknown = sorted(unknown)
        self.accepted = sorted(accepted)
        super().__init__(
            f"{where} got unexpected keyword argument(s) {', '.join(map(repr, self.unknown))}; "
            f"accepted: {', '.join(self.accepted) or '(none)'}."
        )


class InvalidConfigError(ExportLMError, ValueError):
    """A model configuration holds values that cannot build a model (e.g. heads not dividing hidden)."""


class MissingDependencyError(ExportLMError, ImportError):
    """An optional dependency needed for the requested operation is not installed.

    Attributes:
        modules: the import names that could not be imported (``name`` is the first).
        extra: the ``exportlm`` extra that installs them.
        purpose: what needed them, e.g. ``"exporting with the 'onnx' target"``.
    """

    def __init__(self, modules: list[str], extra: str, purpose: str) -> None:
        self.modules = list(modules)
        self.extra = extra
        self.purpose = purpose
        names = ", ".join(self.modules)
        super().__init__(
            f"{purpose} needs {names}, which cannot be imported here. "
            f"Install it with: pip install 'exportlm[{extra}]'",
            name=self.modules[0] if self.modules else None,
        )
