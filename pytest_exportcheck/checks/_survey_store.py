"""The calibrated state of the survey's quantized toy models, shared through a directory.

Calibration (a forward pass, and for ``int4_awq`` the AWQ scale search) is most of
what the quantization survey costs, and every xdist worker used to pay it again.
The quantized models themselves do not pickle (their expert wrappers are classes
made at run time), but what calibration computes is plain data: the quantized
model's state dict (the weights after AWQ smoothing, every amax and scale buffer)
and the margin of each AWQ decision (:func:`exportlm.quant.awq_margin`). That is
what this module stores, under ``CheckServices.shared_dir``:

* ``<key>.safetensors``: the state dict (each tensor copied, so tied weights are
  stored twice and loaded into both names);
* ``<key>.json``: the key, this format, the sha256 of the safetensors file and the
  AWQ margins, signed with this user's HMAC key (:mod:`exportlm.export.trustkey`).

The key covers everything the state depends on: family, recipe, seed, device, a
fingerprint of the built toy model (class, config, state dict bytes), the source
of exportlm and of the package defining the family, and the torch version. Both
files are written with :mod:`exportlm.atomic`, the JSON last, while the writer
holds ``<key>.lock`` (``fcntl``): a second process asking for the same key waits
and then reads what the first wrote (first writer wins), or, when it asked
without waiting, goes on with another key and comes back.

A reader uses an entry only when the JSON is a regular file that verifies (its
signature, key and format), the safetensors bytes match its sha256 and the state
loads strictly (same names and shapes) onto the structure: the toy model
quantized with the same recipe but :func:`exportlm.quant.synthetic_calibration`
(no forward pass). Anything else is logged and computed again, never reported as
a failure of an exporter. This module imports torch; the plugin reaches it only
through the survey.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from exportlm.atomic import write_bytes_atomic, write_text_atomic

__all__ = ["STORE_FORMAT", "CalibratedState", "StateStore", "model_digest", "source_digest"]

logger = logging.getLogger(__name__)

#: Bump when what an entry holds, or its key, changes.
STORE_FORMAT = 1


@dataclass(frozen=True)
class CalibratedState:
    """What calibrating one quantized toy model computed: its state dict and AWQ margins."""

    tensors: dict[str, torch.Tensor]
    margins: dict[str, float]

    @classmethod
    def of(cls, model: nn.Module) -> CalibratedState:
        """The state of a quantized (calibrated) ``model``, copied to the CPU."""
        from exportlm.quant import TensorQuantizer

        tensors = {
            name: value.detach().to("cpu").contiguous().clone()
            for name, value in model.state_dict().items()
        }
        margins = {
            name: float(module.awq_margin)
            for name, module in model.named_modules()
            if isinstance(module, TensorQuantizer) and module.awq_margin is not None
        }
        return cls(tensors, margins)

    def restore(self, structure: nn.Module) -> nn.Module:
        """Load the state onto ``structure`` (same recipe, any calibration) and return it.

        Raises ``RuntimeError`` / ``KeyError`` when the names or shapes differ.
        """
        from exportlm.quant import TensorQuantizer

        device = next((t.device for t in structure.state_dict().values()), torch.device("cpu"))
        structure.load_state_dict({k: v.to(device) for k, v in self.tensors.items()}, strict=True)
        quantizers = {
            name: module
            for name, module in structure.named_modules()
            if isinstance(module, TensorQuantizer)
        }
        unknown = sorted(set(self.margins) - set(quantizers))
        if unknown:
            raise KeyError(f"AWQ margins of quantizers the structure does not have: {unknown[:3]}")
        for name, quantizer in quantizers.items():
            quantizer.awq_margin = self.margins.get(name)
        return structure


def source_digest(module_name: str) -> str:
    """sha256 over the ``.py`` files of the top-level package that defines ``module_name``."""
    top = module_name.split(".", 1)[0]
    digest = hashlib.sha256(top.encode())
    location = getattr(sys.modules.get(top), "__file__", None)
    if location is None:
        return digest.hexdigest()
    path = Path(location)
    files = sorted(path.parent.rglob("*.py")) if path.name == "__init__.py" else [path]
    for file in files:
        digest.update(str(file.relative_to(path.parent)).encode())
        with contextlib.suppress(OSError):
            digest.update(file.read_bytes())
    return digest.hexdigest()


def model_digest(model: nn.Module) -> str:
    """sha256 of a model's class, config and state dict (names, shapes, dtypes, bytes)."""
    digest = hashlib.sha256()
    cls = type(model)
    digest.update(f"{cls.__module__}.{cls.__qualname__}".encode())
    config = getattr(model, "config", None)
    if config is not None:
        to_json = getattr(config, "to_json_string", None)
        digest.update((to_json(use_diff=False) if callable(to_json) else repr(config)).encode())
    for name, tensor in model.state_dict().items():
        host = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{tuple(host.shape)}:{host.dtype}".encode())
        digest.update(host.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _canonical(meta: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in meta.items() if k != "hmac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


class StateStore:
    """Calibrated states under ``root`` (``None``: a store that holds nothing)."""

    def __init__(self, root: Path | None) -> None:
        self.root = root

    @staticmethod
    def key(material: Mapping[str, Any]) -> str:
        """The entry name of ``material`` (JSON-able): a hex sha256 prefix."""
        text = json.dumps({"format": STORE_FORMAT, **material}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    @contextlib.contextmanager
    def lock(self, key: str, *, wait: bool) -> Iterator[bool]:
        """Hold ``<key>.lock``; yields ``False`` when ``wait`` is off and another process holds it."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: racing writers write equal entries
            yield True
            return
        if self.root is None:
            yield True
            return
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"{key}.lock", "a+b") as handle:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def read(self, key: str) -> CalibratedState | None:
        """The verified entry ``key``; ``None`` when there is none or it does not verify."""
        if self.root is None:
            return None
        try:
            return self._read(self.root, key)
        except (OSError, ValueError, KeyError, TypeError) as err:
            logger.info("calibrated state %s not used, computed again: %s", key, err)
            return None

    @staticmethod
    def _read(root: Path, key: str) -> CalibratedState | None:
        from safetensors.torch import load

        from exportlm.export import trustkey

        meta_path, data_path = root / f"{key}.json", root / f"{key}.safetensors"
        if not meta_path.exists():
            return None
        if meta_path.is_symlink() or not meta_path.is_file() or not data_path.is_file():
            raise ValueError("the entry's files are not regular files")
        meta = json.loads(meta_path.read_bytes().decode("utf-8"))
        if not trustkey.verify_signature(_canonical(meta), meta.get("hmac")):
            raise ValueError("its JSON is not signed with this user's exportlm key")
        if meta.get("key") != key or meta.get("format") != STORE_FORMAT:
            raise ValueError(f"its JSON was written for another key or format ({meta.get('key')})")
        data = data_path.read_bytes()
        if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            raise ValueError("its safetensors file does not match its sha256")
        margins = {str(k): float(v) for k, v in dict(meta.get("margins", {})).items()}
        return CalibratedState(load(data), margins)

    def write(self, key: str, state: CalibratedState) -> None:
        """Publish ``state`` as entry ``key`` (call while holding :meth:`lock`)."""
        if self.root is None:
            return
        from safetensors.torch import save

        from exportlm.export import trustkey

        data = save(state.tensors)
        meta: dict[str, Any] = {
            "key": key,
            "format": STORE_FORMAT,
            "sha256": hashlib.sha256(data).hexdigest(),
            "margins": state.margins,
        }
        signature = trustkey.sign(_canonical(meta))
        if signature is None:  # no key to sign with: nothing another process could trust
            return
        meta["hmac"] = signature
        self.root.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(self.root / f"{key}.safetensors", data)
        write_text_atomic(self.root / f"{key}.json", json.dumps(meta, indent=1, sort_keys=True))
