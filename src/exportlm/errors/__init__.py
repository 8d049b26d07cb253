"""Exception classes raised by exportlm, one room of modules by concern, named here.

Every error says what was wrong, what was expected and what to do about it, and
chains the underlying cause (``raise ... from err``) where there is one.
"""

from __future__ import annotations

from exportlm.errors._base import (
    ExportLMError,
    InvalidConfigError,
    MissingDependencyError,
    PluginLoadError,
    RegistryConflictError,
    RegistryError,
    UnknownNameError,
    UnknownOptionError,
)
from exportlm.errors._engines import (
    EngineArtifactRefusedError,
    EngineCrashedError,
    EngineError,
    EngineInterpreterError,
    EngineOutputLimitError,
    EngineProtocolError,
    EngineRefusedError,
    EngineTimeoutError,
    EngineUnavailableError,
)
from exportlm.errors._export import (
    DuplicateTensorError,
    ExportError,
    ExportFailedError,
    InvalidInputError,
    InvalidModelError,
    InvalidOptionError,
    LayerTooLargeError,
    OutputExistsError,
    RuntimeOutputError,
    RuntimeUnavailableError,
    StreamingError,
    StreamingUnsupportedError,
    StreamIntegrityError,
    UnsupportedDtypeError,
    UnsupportedOutputPathError,
)
from exportlm.errors._inputs import (
    ArtifactIntegrityError,
    CustomCodeRefusedError,
    InputTooLargeError,
    MalformedCheckpointError,
    MalformedOnnxError,
    ManifestSchemaError,
    NotRegularFileError,
    UnsafeLockFileError,
    UntrustedArtifactError,
)
from exportlm.errors._quant import (
    DistributedCalibrationError,
    InvalidRecipeError,
    QuantizationError,
    TiedWeightsError,
    UnclaimedModuleError,
    UnknownQuantAlgoError,
    UnsupportedFormatError,
)

__all__ = [
    "ExportError",
    "DuplicateTensorError",
    "ExportFailedError",
    "InvalidConfigError",
    "InvalidInputError",
    "InvalidModelError",
    "InvalidOptionError",
    "InvalidRecipeError",
    "ArtifactIntegrityError",
    "DistributedCalibrationError",
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
    "RuntimeOutputError",
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

# Every class is documented, raised and caught as ``exportlm.errors.<Name>``.
for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
