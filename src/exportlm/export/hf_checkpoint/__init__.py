"""The ``hf_checkpoint`` export target: a (quantized) Hugging Face checkpoint directory.

A built-in target, registered in code (:mod:`~exportlm.export.builtins`):
:func:`export_hf_checkpoint` and its runtime :func:`load_hf_checkpoint`.

One concern per module:

* :mod:`~exportlm.export.hf_checkpoint.target`: the declared target, :func:`export_hf_checkpoint`;
* :mod:`~exportlm.export.hf_checkpoint._write`: the in-memory source, and what every source ends in;
* :mod:`~exportlm.export.hf_checkpoint.directory`: a model directory as the source (streamed or loaded);
* :mod:`~exportlm.export.hf_checkpoint.stream`: the streamed source, one decoder layer at a time;
* :mod:`~exportlm.export.hf_checkpoint.sink`: the driver's sink (names, the layout's tensor rules);
* :mod:`~exportlm.export.hf_checkpoint.shards`: the one safetensors shard writer (threaded or resumable);
* :mod:`~exportlm.export.hf_checkpoint.naming`: checkpoint tensor and module names (``save_pretrained``'s);
* :mod:`~exportlm.export.hf_checkpoint.configs`: ``config.json`` / ``hf_quant_config.json``, ModelOpt and compressed-tensors;
* :mod:`~exportlm.export.hf_checkpoint.runtime`: :func:`load_hf_checkpoint`;
* :mod:`~exportlm.export.hf_checkpoint.formats`: which registered format each stored tensor is in;
* :mod:`~exportlm.export.hf_checkpoint.dequantize`: stored codes and scales back to float weights;
* :mod:`~exportlm.export.hf_checkpoint.experts`: split experts stacked back in the model's own layout;
* :mod:`~exportlm.export.hf_checkpoint.static`: static activation / KV-cache scales re-applied.
"""

from exportlm.export.hf_checkpoint.configs import CHECKPOINT_FORMATS, HF_QUANT_CONFIG_NAME
from exportlm.export.hf_checkpoint.runtime import (
    KVRoundtrip,
    kv_cache_roundtrip,
    load_hf_checkpoint,
)
from exportlm.export.hf_checkpoint.target import (
    build_hf_checkpoint_exporter,
    export_hf_checkpoint,
)

__all__ = [
    "CHECKPOINT_FORMATS",
    "HF_QUANT_CONFIG_NAME",
    "KVRoundtrip",
    "build_hf_checkpoint_exporter",
    "export_hf_checkpoint",
    "kv_cache_roundtrip",
    "load_hf_checkpoint",
]
