"""What a manifest records about the model and the environment: JSON-safe facts, no files.

:func:`model_hash` (the model's exact structure and weights), :func:`json_safe` (options
as JSON data) and :func:`versions` (the libraries an artifact depends on, and the one its
runtime loads with). The manifest
itself, and how artifacts are verified against it, live in
:mod:`~exportlm.export.manifest`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from exportlm._libraries import ARTIFACT_LIBRARIES, installed_version
from exportlm.export._digest import new_hasher

__all__ = [
    "HASH_THREADS",
    "MODEL_HASH_ENV",
    "ModelHashFuture",
    "json_safe",
    "model_hash",
    "model_hash_future",
    "model_hash_wanted",
    "versions",
]


#: Threads that hash a model's tensors (``blake3`` releases the GIL on large buffers).
HASH_THREADS = max(1, min(4, os.cpu_count() or 1))
#: Set to ``1`` for manifests that record the model's hash (``model_blake3``); unset, ``null``.
MODEL_HASH_ENV = "EXPORTLM_MODEL_HASH"


def model_hash_wanted() -> bool:
    """Whether exports hash the model for their manifest (:data:`MODEL_HASH_ENV`; off by default).

    Off by default since issue 44: nothing reads ``model_blake3`` (the trust model is
    every file's digest; the plugin's cache keys on its own hash of the model), and on a
    loaded machine its read of every weight lengthened a checkpoint export by half.
    """
    return os.environ.get(MODEL_HASH_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def model_hash(model: Any, *, threads: int = 1) -> str:
    """BLAKE3 of ``model``'s structure and weights: class, then every state-dict entry in name order.

    Each entry contributes a line ``name|dtype|shape|BLAKE3 of its raw bytes`` (exact: no
    float is compared, the bytes are hashed), so the same weights give the same hash on
    any machine. Hashing each tensor on its own lets ``threads`` workers hash them in
    parallel; the value does not depend on ``threads``. Tensors are read on the CPU; a
    model on the ``meta`` device has no bytes and must be refused before this is called.

    Changed in issue 21: a line held the tensor's bytes themselves, one sha256
    stream over the whole state dict; now it holds their own digest, so the tensors can
    be hashed concurrently (and while the export writes). Changed in issue 44 (manifest
    schema 3): BLAKE3 instead of sha256, the manifest's ``model_blake3``. Same inputs,
    same purity; hashes written before differ from those written now.

    Why it is not derived from what the exporter reads: the state dict holds tensors the
    export never reads as they are (quantizer state, LoRA adapters, tied copies), and the
    module exporters read weights in their own ways (transposed, folded, per expert), so
    the hash of the model would depend on the target and its options. It is one read of
    each weight, which :meth:`~exportlm.export.guard.PendingManifest.hash_model_in_background`
    runs on worker threads while the export converts and writes.
    """
    return model_hash_future(model, threads=threads)()


class ModelHashFuture:
    """:func:`model_hash` being computed on worker threads; call it for the value."""

    def __init__(self, model: Any, threads: int) -> None:
        self._head = f"{type(model).__module__}.{type(model).__qualname__}\n"
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="exportlm-model-hash")
        self._lines: list[str | Future[str]] = []
        state = model.state_dict()
        for name in sorted(state):
            if not hasattr(state[name], "detach"):  # an extra state that is not a tensor
                self._lines.append(f"{name}|{state[name]!r}\n")
                continue
            tensor = state[name].detach()
            dtype = str(tensor.dtype).removeprefix("torch.")
            self._lines.append(f"{name}|{dtype}|{list(tensor.shape)}|")
            self._lines.append(self._pool.submit(_tensor_digest, tensor))
            self._lines.append("\n")

    def __call__(self) -> str:
        """The hash (waits for the workers, which then stop)."""
        try:
            digest = new_hasher()
            digest.update(self._head.encode())
            for line in self._lines:
                digest.update((line if isinstance(line, str) else line.result()).encode())
            return digest.hexdigest()
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Stop: tensors not hashed yet are not read (an export that failed needs no hash)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def model_hash_future(model: Any, *, threads: int = 1) -> ModelHashFuture:
    """Start hashing ``model`` on ``threads`` workers now; calling the result returns :func:`model_hash`.

    The state dict is taken (references only) before this returns; the weights are read
    by the workers.
    """
    return ModelHashFuture(model, threads)


def _tensor_digest(tensor: Any) -> str:
    digest = new_hasher()
    if tensor.numel():
        flat = tensor.cpu().contiguous().reshape(-1)
        digest.update(flat.view(_uint8()).numpy().data)
    return digest.hexdigest()


def _uint8() -> Any:
    import torch

    return torch.uint8


def json_safe(value: Any) -> Any:
    """``value`` as JSON data: tensors become ``{"tensor": shape, "dtype": ...}``, paths and dtypes strings."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return {"tensor": list(shape), "dtype": str(dtype).removeprefix("torch.")}
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value).removeprefix("torch.")


def versions(runtime_library: str = "") -> dict[str, str | None]:
    """Versions of the libraries every artifact depends on
    (:data:`~exportlm._libraries.ARTIFACT_LIBRARIES`) and of ``runtime_library``, the one
    the target's runtime loads with (``TargetInfo.runtime_library``; ``""``: none stated)."""
    found = {name: installed_version(name) for name in ARTIFACT_LIBRARIES}
    if runtime_library:
        found[f"runtime:{runtime_library}"] = installed_version(runtime_library)
    return found
