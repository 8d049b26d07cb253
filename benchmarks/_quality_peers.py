"""The peers' side of ``benchmarks/quality.py``: ModelOpt's and llm-compressor's export of a
model directory, each run by ``quality.py`` as a child process of its own.

``python benchmarks/_quality_peers.py {modelopt,llmcompressor} --model DIR --recipe R
--data RUN.pt --out CKPT --result RESULT.json --spawned T [--no-eval]``: loads the model in
bf16, quantizes it on the calibration batches of ``RUN.pt`` (the very ``input_ids`` rows
our CLI calibrates on, computed by exportlm's own ``calibration_batches``), writes the
producer's checkpoint, records the wall seconds since ``T`` (the parent's clock at the
spawn) and the peak RSS so far, then measures the fake-quantized model in memory (and
ModelOpt's checkpoint through exportlm's ``hf_checkpoint`` runtime) with
``_quality_metrics``. llm-compressor runs in its own venv, which has no exportlm: only
``_quality_metrics`` (torch and the standard library) is imported from here.

The schemes (a recipe a peer lacks is not run; the table shows "—"):

==========================  =====================================  ==========================================
recipe                      ModelOpt 0.47                          llm-compressor 0.14
==========================  =====================================  ==========================================
``fp8``                     ``FP8_DEFAULT_CFG``                    ``FP8`` (static per-tensor inputs)
``fp8+fp8_kv``              that + ``FP8_KV_CFG``                  ``FP8`` + an FP8 per-tensor ``kv_cache_scheme``
``fp8_dynamic``             ``FP8_PER_CHANNEL_PER_TOKEN_CFG``      ``FP8_DYNAMIC``
``int8_sq``                 ``INT8_SMOOTHQUANT_CFG`` (alpha 1.0)   ``SmoothQuantModifier`` (0.5) + int8 channel
                                                                   weights, static per-tensor int8 inputs
``w8a8``                    —                                      ``SmoothQuantModifier`` (0.5) + ``W8A8``
``int8_wo``                 ``INT8_WEIGHT_ONLY_CFG``               int8 channel weights (its ``W8A16``
                                                                   preset is in groups of 128)
``int4_awq:group_size=G``   ``INT4_AWQ_CFG``, block size G         ``AWQModifier``, symmetric int4 group G
``nvfp4``                   ``NVFP4_DEFAULT_CFG``                  ``NVFP4``
``int4_gptq:group_size=G``  ``INT4_BLOCKWISE_WEIGHT_ONLY_CFG``,     ``GPTQModifier``, symmetric int4 group G
                            block size G, ``algorithm: gptq``
                                                                   (``actorder`` / ``dampening`` as given)
``int8_gptq``               ``INT8_WEIGHT_ONLY_CFG``, ``gptq``     ``GPTQModifier``, int8 channel weights
``w4a8_awq:group_size=G``   ``W4A8_AWQ_BETA_CFG``, block size G    ``AWQModifier``, symmetric int4 group G,
                                                                   FP8 static per-tensor inputs (its
                                                                   ``W4AFP8`` preset's are per token)
``fp8_block:group_size=G``  — (weight-only ``FP8_2D_BLOCKWISE``)   ``FP8_BLOCK`` with G x G tiles, input
                                                                   groups of G
``mxfp8``                   ``MXFP8_DEFAULT_CFG``                  ``MXFP8``
``mxfp4``                   ``MXFP4_DEFAULT_CFG``, inputs off      ``MXFP4A16``
``w4afp8:group_size=G``     — (no dynamic-input W4A8)              ``AWQModifier`` with ``W4AFP8``'s scheme:
                                                                   symmetric int4 group G, FP8 inputs per
                                                                   token at run time
==========================  =====================================  ==========================================

An AWQ recipe spelled with ``clip=true`` (``int4_awq:group_size=64,clip=true``) runs
ModelOpt with ``algorithm: awq_full`` (``awq_lite`` and then its ``awq_clip`` search):
ModelOpt's counterpart of our clip search, which is on by default; the plain spelling runs
its ``INT4_AWQ_CFG`` / ``W4A8_AWQ_BETA_CFG`` as shipped (``awq_lite``, no clip).
llm-compressor 0.14's ``AWQModifier`` has no clip search.
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _quality_metrics import (
    export_done,
    float32_matmuls,
    guarded,
    hf_logits,
    load_data,
    measure,
    write_result,
)

MODELOPT_CONFIGS = {
    "fp8": "FP8_DEFAULT_CFG",
    "fp8_dynamic": "FP8_PER_CHANNEL_PER_TOKEN_CFG",
    "int8_sq": "INT8_SMOOTHQUANT_CFG",
    "int8_wo": "INT8_WEIGHT_ONLY_CFG",
    "int4_awq": "INT4_AWQ_CFG",
    "nvfp4": "NVFP4_DEFAULT_CFG",
    "int4_gptq": "INT4_BLOCKWISE_WEIGHT_ONLY_CFG",  # with its GPTQ algorithm (below)
    "int8_gptq": "INT8_WEIGHT_ONLY_CFG",  # with its GPTQ algorithm (below)
    "w4a8_awq": "W4A8_AWQ_BETA_CFG",
    # no fp8_block: ModelOpt 0.47's FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG leaves the inputs in
    # bf16, and its dynamic block quantizer takes only E8M0 / E4M3 scales (MX, NVFP4), not
    # FP8 groups with float32 scales ("scale_bits" asserted in _dynamic_block_quantize_forward)
    "mxfp8": "MXFP8_DEFAULT_CFG",
    "mxfp4": "MXFP4_DEFAULT_CFG",  # W4A4 in ModelOpt: its input quantizer is disabled (below)
}
LLMC_SCHEMES = {
    "fp8": "FP8",
    "fp8_dynamic": "FP8_DYNAMIC",
    "nvfp4": "NVFP4",
    "mxfp8": "MXFP8",
    "mxfp4": "MXFP4A16",
}


def split_recipe(recipe: str) -> tuple[str, bool, dict[str, Any]]:
    """``("int4_awq", False, {"group_size": 64})`` of ``"int4_awq:group_size=64"``;
    the middle value says whether ``+fp8_kv`` was added."""
    parts = recipe.split("+")
    kv = "fp8_kv" in parts[1:]
    name, _, rest = parts[0].partition(":")
    items = (item.partition("=") for item in rest.split(",") if item)
    return name, kv, {k: _option(v) for k, _, v in items}


def _option(raw: str) -> Any:
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            continue
    return raw


def supports(peer: str, recipe: str) -> bool:
    """Whether ``peer`` has a scheme for ``recipe`` (else its cell is "—")."""
    name, _, _ = split_recipe(recipe)
    if peer == "modelopt":
        return name in MODELOPT_CONFIGS
    return name in LLMC_SCHEMES or name in (
        "int8_sq", "w8a8", "int8_wo", "int4_awq", "int4_gptq", "int8_gptq", "fp8_block",
        "w4a8_awq", "w4afp8",
    )  # fmt: skip


def modelopt_config(mtq: Any, recipe: str) -> dict[str, Any]:
    name, kv, options = split_recipe(recipe)
    config = copy.deepcopy(getattr(mtq, MODELOPT_CONFIGS[name]))
    if "group_size" in options:  # the INT4 weight block size (128 by default)
        for entry in config["quant_cfg"]:
            if entry.get("quantizer_name") == "*weight_quantizer" and "cfg" in entry:
                # W4A8_AWQ_BETA_CFG: a list of two (INT4 in groups, then FP8 per tensor)
                first = entry["cfg"][0] if isinstance(entry["cfg"], list) else entry["cfg"]
                first["block_sizes"][-1] = options["group_size"]
    if kv:
        config["quant_cfg"] = [*config["quant_cfg"], *mtq.FP8_KV_CFG["quant_cfg"]]
    if name == "mxfp4":  # weight-only, as gpt-oss ships it (ModelOpt's preset is W4A4)
        config["quant_cfg"] = [_weights_only(entry) for entry in config["quant_cfg"]]
    if options.get("clip") in ("true", True):  # our clip search: ModelOpt's awq_full
        config["algorithm"] = {"method": "awq_full", "alpha_step": 0.1}  # awq_lite + awq_clip
    if name in ("int4_gptq", "int8_gptq"):  # ModelOpt 0.47's GPTQCalibConfig
        config["algorithm"] = {"method": "gptq", "perc_damp": options.get("dampening", 0.01)}
    return config


def _weights_only(entry: dict[str, Any]) -> dict[str, Any]:
    if entry.get("quantizer_name") == "*input_quantizer":
        return {"quantizer_name": "*input_quantizer", "enable": False}
    return entry


def _bf16_model(directory: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()


def evaluate(
    args: argparse.Namespace, data: dict[str, Any], result: dict[str, Any], model: Any
) -> None:
    """The fake-quantized model in memory, measured (its seconds are not the export's; its
    one-row forwards stay below the calibration's 8-row ones in memory)."""
    if not args.no_eval:
        result["mem"] = guarded(result, "mem_error", lambda: measure(hf_logits(model), data))


def run_modelopt(args: argparse.Namespace, data: dict[str, Any], result: dict[str, Any]) -> None:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    model = _bf16_model(args.model)

    def forward_loop(m: Any) -> None:
        with torch.no_grad():
            for batch in data["batches"]:
                m(batch)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with float32_matmuls():  # quality.py --float32-matmuls (else nothing)
            mtq.quantize(model, modelopt_config(mtq, args.recipe), forward_loop=forward_loop)
        # Measured before the export, which replaces the weights by their quantized bytes.
        evaluate(args, data, result, model)
        export_hf_checkpoint(model, export_dir=args.out)
    export_done(result, args.spawned)
    if args.no_eval:
        return
    del model

    def checkpoint() -> dict[str, float]:
        import exportlm

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no manifest: ModelOpt does not write ours
            run = exportlm.load_exported("hf_checkpoint", args.out, trust=True)
        return measure(run, data)

    result["ckpt"] = guarded(result, "ckpt_error", checkpoint)


def llmc_recipe(recipe: str) -> list[Any]:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import SmoothQuantModifier

    name, kv, options = split_recipe(recipe)
    kv_scheme = (
        QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
        if kv
        else None
    )
    if name == "int4_awq":
        weights = QuantizationArgs(
            num_bits=4, type="int", symmetric=True, strategy="group",
            group_size=options.get("group_size", 128),
        )  # fmt: skip
        groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
        return [AWQModifier(ignore=["lm_head"], config_groups=groups)]
    if name in ("int4_gptq", "int8_gptq"):  # our actorder "weight" is its "static"
        return [_gptq_modifier(name, options)]
    if name == "int8_wo":  # per output channel, as ours and ModelOpt's: its W8A16 preset
        # quantizes in groups of 128, which 576 input features do not divide
        weights = QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True)
        scheme = QuantizationScheme(targets=["Linear"], weights=weights)
        return [QuantizationModifier(ignore=["lm_head"], config_groups={"group_0": scheme})]
    if name == "int8_sq":  # ModelOpt's INT8_SQ layout: channel weights, static tensor inputs
        scheme = QuantizationScheme(
            targets=["Linear"],
            weights=QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True),
            input_activations=QuantizationArgs(
                num_bits=8, type="int", strategy="tensor", symmetric=True, dynamic=False
            ),
        )
        quant = QuantizationModifier(ignore=["lm_head"], config_groups={"group_0": scheme})
        return [SmoothQuantModifier(), quant]
    if name == "w8a8":
        return [SmoothQuantModifier(), QuantizationModifier(ignore=["lm_head"], scheme="W8A8")]
    if name in ("fp8_block", "w4a8_awq", "w4afp8"):
        return _llmc_custom(name, options)
    return [
        QuantizationModifier(
            targets="Linear",
            ignore=["lm_head"],
            scheme=LLMC_SCHEMES[name],
            kv_cache_scheme=kv_scheme,
        )
    ]


def _llmc_custom(name: str, options: dict[str, Any]) -> list[Any]:
    """``fp8_block`` at a block size G: its ``FP8_BLOCK`` preset with G x G tiles and input
    groups of G. ``w4a8_awq``: ``AWQModifier`` with its ``W4AFP8`` weights (symmetric int4,
    group G) and FP8 *static per-tensor* inputs (``W4AFP8``'s are per token, dynamic).
    ``w4afp8``: ``AWQModifier`` with the ``W4AFP8`` preset's scheme at group G."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier

    group = options.get("group_size", 128)
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    if name == "fp8_block":
        scheme = QuantizationScheme(
            targets=["Linear"],
            weights=QuantizationArgs(**fp8, strategy="block", block_structure=[group, group]),
            input_activations=QuantizationArgs(
                **fp8, strategy="group", group_size=group, dynamic=True
            ),
        )
        return [QuantizationModifier(ignore=["lm_head"], config_groups={"group_0": scheme})]
    if name == "w4afp8":  # the preset itself (quant_scheme.py W4AFP8) at group size G
        from compressed_tensors.quantization import preset_name_to_scheme

        scheme = preset_name_to_scheme("W4AFP8", ["Linear"])
        scheme.weights.group_size = group
        return [AWQModifier(ignore=["lm_head"], config_groups={"group_0": scheme})]
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(
            num_bits=4, type="int", symmetric=True, strategy="group", group_size=group
        ),
        input_activations=QuantizationArgs(
            **fp8, strategy="tensor", dynamic=False, observer="static_minmax"
        ),
    )
    return [AWQModifier(ignore=["lm_head"], config_groups={"group_0": scheme})]


def _gptq_modifier(name: str, options: dict[str, Any]) -> Any:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.gptq import GPTQModifier

    if name == "int8_gptq":  # int8_wo's per-channel codes
        weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    else:
        weights = QuantizationArgs(
            num_bits=4, type="int", symmetric=True, strategy="group",
            group_size=options.get("group_size", 128),
        )  # fmt: skip
    actorder = options.get("actorder", "weight")
    return GPTQModifier(
        ignore=["lm_head"],
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        actorder=None if actorder == "none" else actorder,
        dampening_frac=float(options.get("dampening", 0.01)),
    )


def _no_pinning_without_a_device() -> None:
    """llm-compressor 0.14's AWQ pins its cached activations before each smoothing search
    (``IntermediatesCache.pin_memory``, "for faster onloading"), and pinning needs an NVIDIA
    driver: on a CPU-only machine every AWQ recipe fails with "Found no NVIDIA driver".
    Pinning only speeds host-to-device copies, so without a device it is made a no-op; the
    search itself is unchanged."""
    if torch.cuda.is_available():
        return
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None


def run_llmcompressor(
    args: argparse.Namespace, data: dict[str, Any], result: dict[str, Any]
) -> None:
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoTokenizer

    _no_pinning_without_a_device()
    model = _bf16_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = [row for batch in data["batches"] for row in batch.tolist()]
    same_length = len({len(row) for row in rows}) == 1
    oneshot(
        model=model,
        processor=tokenizer,
        dataset=Dataset.from_dict(
            {"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]}
        ),
        recipe=llmc_recipe(args.recipe),
        batch_size=len(data["batches"][0]) if same_length else 1,  # the CLI's rows per forward
        num_calibration_samples=len(rows),
        max_seq_length=max(len(row) for row in rows),
        shuffle_calibration_samples=False,
    )
    evaluate(args, data, result, model)  # before the save, which compresses the weights
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    export_done(result, args.spawned)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("peer", choices=["modelopt", "llmcompressor"])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--spawned", type=float, required=True)
    parser.add_argument("--no-eval", action="store_true")
    args = parser.parse_args()
    data = load_data(args.data)
    result: dict[str, Any] = {}
    try:
        (run_modelopt if args.peer == "modelopt" else run_llmcompressor)(args, data, result)
    finally:
        write_result(args.result, result)


if __name__ == "__main__":
    main()
