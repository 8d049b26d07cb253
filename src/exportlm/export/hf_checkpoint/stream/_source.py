"""The on-disk checkpoint a streaming export reads: a meta-device skeleton and lazy shards.

:class:`CheckpointSource` builds the model on the ``meta`` device from ``config.json``
(no weight is allocated) and fills one module at a time from the safetensors shards
(never ``torch.load``): :meth:`CheckpointSource.load` gives a module real CPU storage
and reads its tensors into it from the shards (each header validated as the
``hf_checkpoint`` loader validates it; bytes read straight into the module's storage,
converted to the model's dtype where the shard holds another), and
:meth:`CheckpointSource.free` puts it back on ``meta``.

Tensors are read under the names transformers loads them from. Mixtral and Qwen2-MoE /
Qwen3-MoE checkpoints hold their experts one tensor per expert
(``block_sparse_moe.experts.3.w1.weight``, ``mlp.experts.3.gate_proj.weight``) that
transformers fuses on load into ``experts.gate_up_proj [E, 2I, H]`` and
``experts.down_proj [E, H, I]``: :class:`~exportlm.export.hf_checkpoint.stream._names.CheckpointNames` reads each expert's tensor into
its region of the fused parameter (see there).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from exportlm.errors import InvalidConfigError, MalformedCheckpointError
from exportlm.export.hf_checkpoint.sink import SAFETENSORS_DTYPES
from exportlm.export.hf_checkpoint.stream._names import CheckpointNames
from exportlm.export.hf_checkpoint.stream._stored_extras import check_stored_ties
from exportlm.hfdir import (
    CONFIG_NAME,
    read_config,
    vet_model_directory,
)
from exportlm.source_config import stored_weight_map

__all__ = [
    "FLOAT_STORAGE",
    "CheckpointSource",
    "DecoderLayout",
    "meta_model",
    "stored_codes_problem",
]

#: safetensors dtype tag -> torch dtype (the writer's table, inverted).
_TORCH_DTYPES = {tag: dtype for dtype, tag in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class DecoderLayout:
    """Where a decoder's layers are: ``layers`` is the ``nn.ModuleList`` path (``model.layers``)."""

    layers: str
    count: int

    def prefix(self, index: int) -> str:
        """The module path of layer ``index`` (``model.layers.3``)."""
        return f"{self.layers}.{index}"


class CheckpointSource:
    """A local Hugging Face model directory, read lazily.

    Attributes:
        directory: the model directory.
        model: the causal LM on the ``meta`` device (loaded modules hold CPU tensors).
        layout: where its decoder layers are.
        shard_of: ``{tensor name: shard file}`` from the index (or the single file).
    """

    def __init__(self, directory: Path, model: nn.Module | None = None) -> None:
        self.directory = Path(directory)
        vet_model_directory(self.directory)
        # ``model``: this directory's meta_model, already built (and checked against a recipe)
        self.model: Any = meta_model(self.directory) if model is None else model
        self.layout = _decoder_layout(self.model)
        self.shard_of = stored_weight_map(self.directory)
        self._names = CheckpointNames(self.model)
        self._headers: dict[str, tuple[int, dict[str, Any]]] = {}
        from exportlm.module_exporters import resolve_tied_weights

        self._ties = resolve_tied_weights(self.model)  # {dropped name: saved name}
        check_stored_ties(self, self._ties)

    @property
    def namer(self) -> Any:
        """The exporter's :class:`~exportlm.export.hf_checkpoint.naming.CheckpointNamer` of the model."""
        return self._names.namer

    @property
    def reads_names(self) -> bool:
        """True when :meth:`load` reads every tensor under the checkpoint's own names.

        The model's tensor names are the checkpoint's, or the only conversions
        transformers applies on load are per-expert tensors fused into 3-D experts
        (Mixtral, Qwen2-MoE, Qwen3-MoE), with renamings. Any other conversion is False.
        """
        return self._names.readable

    @property
    def shard_bytes(self) -> int:
        """The size of the largest shard file."""
        return max((self.directory / f).stat().st_size for f in set(self.shard_of.values()))

    @property
    def total_bytes(self) -> int:
        """The size of all shard files together (the model on disk)."""
        return sum((self.directory / f).stat().st_size for f in set(self.shard_of.values()))

    def layer(self, index: int) -> nn.Module:
        """Decoder layer ``index`` (on ``meta`` until :meth:`load`)."""
        layer: nn.Module = self.model.get_submodule(self.layout.prefix(index))
        return layer

    def tensor_bytes(self, module: nn.Module) -> int:
        """Bytes of ``module``'s parameters and buffers in the model's dtype."""
        tensors = [*module.parameters(), *module.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def load(self, prefix: str, *, recurse: bool = True) -> nn.Module:
        """Give module ``prefix`` CPU storage and its checkpoint tensors; returns it.

        ``recurse=False``: only the module's own tensors (not its children's). Each
        tensor is read from its shard straight into the module's storage (no mapping,
        no intermediate copy, see :meth:`_read_into`).

        A fused experts parameter (Mixtral's ``experts.gate_up_proj``) is read from its
        per-expert tensors, each into its region of the parameter.

        Raises:
            MalformedCheckpointError: a tensor the module needs (one expert's included)
                is in no shard, or has another shape there, or the shard's header is
                malformed.
            InvalidConfigError: the model converts a tensor's name on load in a way this
                reader does not (see :attr:`reads_names`).
        """
        module: nn.Module = self.model.get_submodule(prefix)
        module.to_empty(device="cpu", recurse=recurse)
        own = [*module.named_parameters(recurse=recurse), *module.named_buffers(recurse=recurse)]
        state = {k: v for k, v in module.state_dict(keep_vars=True).items() if k in dict(own)}
        base = f"{prefix}." if prefix else ""
        with torch.no_grad():
            for name, tensor in state.items():
                for stored, region, what in self._names.pieces(base + name, tensor):
                    self._read_into(self._saved_name(stored), region, what)
        _rebuild_unsaved_buffers(module, self.model.config, recurse)
        self._retie()
        return module

    def free(self, module: nn.Module, *, recurse: bool = True) -> None:
        """Release ``module``'s storage (back to ``meta``); ``recurse=False``: its own only."""
        module.to_empty(device="meta", recurse=recurse)
        self._retie()

    def saved(self, names: Iterable[str]) -> set[str]:
        """``names`` without the tied copies (a tied ``lm_head.weight``), which no export reads."""
        return {n for n in names if n not in self._ties}

    def _retie(self) -> None:
        """``to_empty`` gives each module new tensors: share a tied pair's one again."""
        if self._ties:
            self.model.tie_weights()

    def close(self) -> None:
        """Forget the shards' headers (no file stays open between reads)."""
        self._headers.clear()

    def _saved_name(self, name: str) -> str:
        """``name``, or the tensor a tied copy is saved as (a tied ``lm_head``)."""
        if name not in self.shard_of and name in self._ties:
            return self._ties[name]
        return name

    def _read_into(self, name: str, tensor: torch.Tensor, what: str = "") -> None:
        """Read checkpoint tensor ``name`` into ``tensor`` with ``readinto``.

        ``what`` says, for messages, what the tensor is part of (one expert of a fused
        parameter); ``tensor`` may be a contiguous region of the module's storage.

        A memory-mapped read would count every page it touches in the process's RSS
        until the shard is unmapped, and ``safe_open`` copies the tensor out before it
        reaches the module: twice a layer resident while it loads. Read this way, only
        the module's own storage is (a tensor stored in another dtype goes through one
        temporary of its size).
        """
        shard = self.shard_of.get(name)
        part = f" ({what})" if what else ""
        if shard is None:
            raise MalformedCheckpointError(
                f"{self.directory}: no shard holds tensor {name!r}{part}, which the model's "
                "config needs; expected a complete checkpoint as save_pretrained writes it"
            )
        start, infos = self.header(shard)
        info = infos.get(name)
        if info is None or tuple(info.shape) != tuple(tensor.shape):
            found = "no such tensor" if info is None else f"shape {list(info.shape)}"
            raise MalformedCheckpointError(
                f"{self.directory}: tensor {name!r}{part} has {found} in {shard}, the config "
                f"expects {list(tensor.shape)}"
            )
        stored = _TORCH_DTYPES.get(info.dtype)
        if stored is None:
            raise MalformedCheckpointError(
                f"{self.directory / shard}: tensor {name!r} has dtype {info.dtype}, "
                "which a model's weights cannot be read from"
            )
        codes = stored_codes_problem(f"tensor {name!r}{part}", info.dtype, tensor)
        if codes is not None:  # a cast would make the codes weights, silently
            raise MalformedCheckpointError(f"{self.directory / shard}: {codes}")
        direct = stored == tensor.dtype and tensor.is_contiguous()
        target = tensor if direct else torch.empty(tensor.shape, dtype=stored)
        begin, end = info.offsets
        view = target.reshape(-1).view(torch.uint8).numpy().data
        with open(self.directory / shard, "rb") as f:
            f.seek(start + begin)
            got = f.readinto(view) if len(view) else 0
        if got != end - begin:
            raise MalformedCheckpointError(
                f"{self.directory / shard}: tensor {name!r} is truncated ({got} of "
                f"{end - begin} bytes)"
            )
        if not direct:
            tensor.copy_(target)

    def header(self, shard: str) -> tuple[int, dict[str, Any]]:
        """Where ``shard``'s data starts and its tensors (validated header, read once)."""
        if shard not in self._headers:
            from exportlm.inspection import read_safetensors_header

            path = self.directory / shard
            infos = read_safetensors_header(path)
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
            self._headers[shard] = (8 + length, infos)
        return self._headers[shard]

    def names(self) -> Iterator[str]:
        """Every tensor name of the checkpoint."""
        return iter(self.shard_of)

    def stored_names(self) -> set[str]:
        """The checkpoint tensors :meth:`load` reads the whole model from (tied copies as the
        tensor they are saved as; a fused expert parameter as its per-expert tensors)."""
        state = self.model.state_dict(keep_vars=True)
        return {
            self._saved_name(stored)
            for name in self.saved(state)
            for stored, _, _ in self._names.pieces(name, state[name])
        }


#: The safetensors dtypes a float model's weights are stored in; any other is a quantized
#: checkpoint's codes (int8, uint8, int32 packs, float8) or no weight at all.
FLOAT_STORAGE = ("F64", "F32", "F16", "BF16")


def stored_codes_problem(subject: str, stored: str, want: torch.Tensor) -> str | None:
    """Why ``subject``, a float parameter like ``want``, cannot be read from a tensor stored
    as ``stored`` (a safetensors dtype), in words; ``None`` when it can."""
    if not want.is_floating_point() or stored in FLOAT_STORAGE:
        return None
    return (
        f"{subject} is stored as {stored}, where the model has a float weight: the codes of a "
        f"quantized checkpoint, not a float model's weights (expected one of "
        f"{', '.join(FLOAT_STORAGE)})"
    )


def meta_model(directory: Path) -> Any:
    """The directory's causal LM on the ``meta`` device, from its ``config.json`` alone (no
    weight read), in eval mode with its generation config.

    Raises:
        InvalidConfigError: a ``config.json`` transformers cannot read.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from exportlm.hfdir import transformers_errors
    from exportlm.source_config import check_source_config

    where = str(directory / CONFIG_NAME)
    check_source_config(directory, read_config(directory), where)
    with transformers_errors(where, "build a causal LM"):
        config = AutoConfig.from_pretrained(
            directory, local_files_only=True, trust_remote_code=False
        )
        dtype = getattr(config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        with torch.device("meta"):
            # eager attention, as the in-memory export loads a directory (source_model.py)
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, trust_remote_code=False, attn_implementation="eager"
            )
    model.tie_weights()  # one parameter for a tied pair, as from_pretrained leaves it
    with transformers_errors(str(directory / "generation_config.json"), "read a generation config"):
        _load_generation_config(model, directory)
    return model.eval()


def _load_generation_config(model: Any, directory: Path) -> None:
    """The generation config ``from_pretrained`` gives the model (so the exported
    ``generation_config.json`` is the in-memory export's): the directory's
    ``generation_config.json``, else one made from ``config.json``. ``from_config``
    alone derives it from the config object, which keeps defaults (``bos_token_id``,
    ``use_cache``) that ``from_pretrained`` does not write."""
    from transformers import GenerationConfig

    if not model.can_generate():
        return
    try:
        model.generation_config = GenerationConfig.from_pretrained(directory, local_files_only=True)
    except OSError:  # no generation_config.json: what from_pretrained falls back to
        model.generation_config = GenerationConfig.from_pretrained(
            directory, config_file_name=CONFIG_NAME, _from_model_config=True, local_files_only=True
        )


def _decoder_layout(model: nn.Module) -> DecoderLayout:
    """The one ``nn.ModuleList`` of decoder layers (the longest list of the model)."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise InvalidConfigError(
            f"{type(model).__name__} has no list of decoder layers to stream layer by layer"
        )
    name, layers = max(lists, key=lambda item: (len(item[1]), -item[0].count(".")))
    return DecoderLayout(name, len(layers))


def _rebuild_unsaved_buffers(module: nn.Module, config: Any, recurse: bool) -> None:
    """Recompute buffers a checkpoint does not hold (rotary ``inv_freq``) as ``__init__`` does."""
    for name, child in module.named_modules() if recurse else [("", module)]:
        saved = set(child.state_dict(keep_vars=True))
        unsaved = [b for b, _ in child.named_buffers(recurse=False) if b not in saved]
        if not unsaved:
            continue
        try:
            fresh = type(child)(config=config)
        except TypeError as err:
            raise InvalidConfigError(
                f"module {name or type(module).__name__} ({type(child).__name__}) has computed "
                "buffers that streaming cannot rebuild from the config"
            ) from err
        for buffer in unsaved:
            setattr(child, buffer, getattr(fresh, buffer))
