"""Exception classes raised by exportlm.

Every error says what was wrong, what was expected and what to do about it, and
chains the underlying cause (``raise ... from err``) where there is one.
"""

from __future__ import annotations

__all__ = [
    "ExportError",
    "DuplicateTensorError",
    "ExportFailedError",
    "InvalidConfigError",
    "InvalidInputError",
    "InvalidModelError",
    "ArtifactIntegrityError",
    "ExportLMError",
    "ManifestSchemaError",
    "MalformedCheckpointError",
    "MalformedOnnxError",
    "CustomCodeRefusedError",
    "NotRegularFileError",
    "InputTooLargeError",
    "MissingDependencyError",
    "OutputExistsError",
    "PluginLoadError",
    "QuantizationError",
    "RegistryConflictError",
    "RuntimeUnavailableError",
    "RegistryError",
    "TiedWeightsError",
    "UnclaimedModuleError",
    "UnknownNameError",
    "UnknownQuantAlgoError",
    "UnknownOptionError",
    "UnsupportedDtypeError",
    "UnsupportedFormatError",
    "UnsupportedOutputPathError",
    "UntrustedArtifactError",
    "EngineCrashedError",
    "EngineError",
    "EngineInterpreterError",
    "EngineProtocolError",
    "EngineRefusedError",
    "EngineTimeoutError",
    "EngineUnavailableError",
    "EngineArtifactRefusedError",
    "EngineOutputLimitError",
    "LayerTooLargeError",
    "StreamingError",
    "StreamIntegrityError",
    "StreamingUnsupportedError",
    "UnsafeLockFileError",
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


class ExportError(ExportLMError):
    """Base class of errors raised while exporting."""


class ExportFailedError(ExportError):
    """The underlying exporter (torch.onnx, torch.jit, torch.export, ...) failed."""


class StreamingError(ExportError):
    """A layer-by-layer (streaming) export cannot proceed (:mod:`exportlm.stream`)."""


class StreamingUnsupportedError(StreamingError, ValueError):
    """The model family or recipe does not stream yet; the message names what, and the
    in-memory export to use instead."""


class LayerTooLargeError(StreamingError, MemoryError):
    """A streaming export does not fit its memory budget: the largest set of modules
    loaded at once (a decoder layer, the embedding), the output shard being filled and
    one linear in float32 need more than ``--max-memory`` / ``max_memory``."""


class StreamIntegrityError(StreamingError):
    """A streamed checkpoint does not hold together before it is published (a decoder layer or
    a module of the model missing from what was written): nothing is published, and the work
    area is removed so that the next run starts afresh."""

    def __init__(self, problem: str) -> None:
        self.problem = problem
        super().__init__(
            f"{problem}; nothing was published. The work area was changed outside this export "
            "or exportlm has a bug; it was removed, so exporting again starts afresh (report "
            "it if it happens again)"
        )


class RuntimeUnavailableError(ExportLMError, RuntimeError):
    """The requested runtime device (e.g. ``cuda``) is not available on this machine."""


class InvalidModelError(ExportError, TypeError):
    """The model does not have the shape an export target expects."""


class InvalidInputError(ExportError, TypeError):
    """Example inputs or runtime inputs are not what the target expects."""


class OutputExistsError(ExportError, FileExistsError):
    """The output path exists and overwriting was not requested."""


class UnsupportedOutputPathError(OutputExistsError):
    """The output path exists and is neither a regular file nor a directory (a device, FIFO, socket)."""


class NotRegularFileError(ExportLMError, ValueError):
    """A path given to exportlm is not the kind of file expected (a FIFO, device or socket, usually).

    Raised before the path is opened for reading (a FIFO would block a reader
    forever, a device never ends). Attributes: ``path``, ``what`` (the role of the
    file, e.g. ``"calibration data"``), ``kind`` (what it is: ``"FIFO"``,
    ``"directory"``...) and ``expected`` (``"regular file"`` or ``"directory"``).
    """

    def __init__(self, path: object, what: str, kind: str, expected: str = "regular file") -> None:
        self.path = path
        self.what = what
        self.kind = kind
        self.expected = expected
        super().__init__(
            f"{what} {path} is a {kind}, not a {expected}; exportlm reads {what} only "
            f"from a {expected} (a FIFO or device could block or never end). "
            f"Pass the path of a {expected}."
        )


class InputTooLargeError(ExportLMError, ValueError):
    """An input over its size limit, refused before it is read or built: the message names
    the size, the limit and how to go on. Attributes: ``what``, ``size`` (or ``None``), ``limit``."""

    def __init__(self, message: str, *, what: str, size: int | None, limit: int) -> None:
        self.what, self.size, self.limit = what, size, limit
        super().__init__(message)


class UnsupportedDtypeError(InvalidInputError):
    """A dtype was asked that the target (or its runtime) cannot export or run."""


class UntrustedArtifactError(ExportLMError):
    """Loading the artifact could execute code, and nothing proves it was written here.

    Raised by :func:`exportlm.export.load_exported` before anything is read by the
    format's loader. The message names the file, the risk and the flag
    (``trust=True``; ``--trust`` on the command line).
    """


class CustomCodeRefusedError(UntrustedArtifactError):
    """A model directory needs Python code of its own (``auto_map``, ``*.py``) to load.

    exportlm never runs a checkpoint's code (it passes ``trust_remote_code=False``
    to every transformers call and never prompts). Raised before transformers is
    asked to read the directory. Attributes: ``path`` and ``reasons`` (what would
    have run).
    """

    def __init__(self, path: object, reasons: list[str]) -> None:
        self.path = path
        self.reasons = list(reasons)
        super().__init__(
            f"{path} needs code of its own to load ({'; '.join(self.reasons)}); exportlm never "
            "runs a checkpoint's code. Load the model yourself with code you have reviewed and "
            "pass the nn.Module to exportlm's Python API, or convert the checkpoint to an "
            "architecture that transformers ships (config.json without auto_map)."
        )


class MalformedCheckpointError(ExportLMError, ValueError):
    """A checkpoint file (config, index, safetensors header, tensor) is malformed.

    The message names the file and, where there is one, the field or tensor.
    Attributes: ``path`` (the file), ``field`` (the key or tensor name, or ``None``).
    """

    def __init__(self, message: str, path: object = None, field: str | None = None) -> None:
        self.path = path
        self.field = field
        super().__init__(message)


class MalformedOnnxError(MalformedCheckpointError):
    """An ONNX file onnxruntime would refuse: a custom-domain operator, external data outside
    its directory (by name or link), missing or truncated external data, an opset too old.

    Raised by the ``onnx`` runtime before onnxruntime creates a session, and for any
    error onnxruntime still raises creating one. ``field`` is the operator or initializer.
    """


class ArtifactIntegrityError(ExportLMError):
    """An artifact does not match its manifest (a file differs, is missing or is extra).

    Attributes:
        path: the file that differs, is missing or is extra (or the manifest itself).
    """

    def __init__(self, message: str, path: object = None) -> None:
        self.path = path
        super().__init__(message)


class ManifestSchemaError(ArtifactIntegrityError):
    """A manifest is unreadable: not JSON, or a schema version this exportlm does not know."""


class QuantizationError(ExportLMError):
    """Base class of fake-quantization and quantized-export errors."""


class UnsupportedFormatError(QuantizationError, ValueError):
    """A quantization format cannot be applied to a module or tensor of this shape."""


class UnclaimedModuleError(QuantizationError, ExportError):
    """A quantized module was not claimed by any registered module exporter."""


class TiedWeightsError(QuantizationError, ExportError):
    """Tensors declared tied hold different values."""


class DuplicateTensorError(ExportFailedError):
    """One checkpoint tensor name was written twice in one export.

    Raised by the export context and by the checkpoint sink; the message names the
    tensor and the module exporter (and module) that wrote it the second time.
    """


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


class UnknownQuantAlgoError(MalformedCheckpointError, UnsupportedFormatError):
    """A checkpoint declares a ``quant_algo`` (or scheme) that no registered format and no
    known loader has: the checkpoint is malformed for this exportlm, and the format is
    unsupported until one is registered (``exportlm.quant.formats.register_format``).
    """


class EngineError(ExportLMError):
    """A serving engine (run out of process by :mod:`exportlm.engines`) did not serve an artifact.

    Attributes:
        engine: the engine's registered name (``"vllm"``).
        version: the engine's version where the worker got far enough to read it, else ``None``.
        detail: the engine's own error text (its exception type and message, or the tail
            of the worker's stderr), trimmed to its last lines; never our traceback.
    """

    def __init__(self, engine: str, version: str | None, summary: str, detail: str = "") -> None:
        self.engine = engine
        self.version = version
        self.detail = detail
        label = f"{engine} {version}" if version else engine
        text = f"{label}: {summary}"
        super().__init__(f"{text}\n{detail}" if detail else text)


class EngineUnavailableError(EngineError):
    """No interpreter runs the engine here: none was given, or the engine does not import in it."""


class EngineInterpreterError(EngineError, ValueError):
    """An interpreter given for an engine (option or environment variable) is not an executable."""


class EngineRefusedError(EngineError):
    """The engine refused to load or run the artifact; ``stage`` says where (``load``, ...)."""

    def __init__(self, engine: str, version: str | None, stage: str, detail: str) -> None:
        self.stage = stage
        super().__init__(engine, version, f"refused the artifact at stage {stage!r}", detail)


class EngineCrashedError(EngineError):
    """The engine's worker exited without a response (a crash); ``returncode`` is its status."""

    def __init__(self, engine: str, version: str | None, returncode: int, detail: str) -> None:
        self.returncode = returncode
        summary = f"the worker exited with status {returncode} without a response"
        super().__init__(engine, version, summary, detail)


class EngineTimeoutError(EngineError, TimeoutError):
    """The engine's worker ran past its timeout and was killed with its process group."""

    def __init__(self, engine: str, version: str | None, timeout: float, detail: str) -> None:
        self.timeout = timeout
        summary = f"the worker ran past its {timeout:g} s timeout and was killed"
        super().__init__(engine, version, summary, detail)


class EngineProtocolError(EngineError):
    """The worker's response is not the JSON the worker protocol describes (``docs/engines.md``)."""


class UnsafeLockFileError(ExportLMError):
    """A lock file's path is not a private regular file of this user (a symbolic link, ...).

    Lock files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and an existing one is
    opened only when it is a regular file this user owns with one link: a planted
    symbolic link would otherwise make the open create or lock the file it points to.
    Attributes: ``path`` and ``problem`` (what it is).
    """

    def __init__(self, path: object, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(
            f"lock file {path} is {problem}, not a private regular file of this user; it was "
            "not opened (a planted link would make the lock create or lock the file it points "
            f"to). Remove {path} if nobody else should have put it there."
        )


class EngineArtifactRefusedError(CustomCodeRefusedError):
    """An artifact would make a serving engine load a library or run Python of its own
    (``*.so``, ``*.py``, ``custom_generate/``, ``auto_map``, ``custom_ops_library``);
    refused before any worker starts. Attributes: ``path``, ``reasons``, ``engine``."""

    def __init__(self, path: object, reasons: list[str], engine: str) -> None:
        self.path, self.reasons, self.engine = path, list(reasons), engine
        ExportLMError.__init__(
            self,
            f"{path}: refused before engine {engine!r} saw it, as it would run the artifact's "
            f"own code ({'; '.join(self.reasons)}); an artifact is data. Serve one exportlm "
            "wrote, from a folder holding only it, or remove what is named if you reviewed it.",
        )


class EngineOutputLimitError(EngineProtocolError):
    """A worker wrote more than ``limit`` bytes of ``what`` (output or response); it was killed."""

    def __init__(self, engine: str, version: str | None, what: str, limit: int, detail: str):
        self.limit, self.what = limit, what
        summary = f"the worker wrote more than {limit} bytes ({limit / 2**20:g} MiB) of {what}"
        super().__init__(engine, version, summary + ", the cap; it was killed", detail)
