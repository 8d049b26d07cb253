"""The survey's quantized toy models: built once per services, calibrated once per run.

Internal to :mod:`pytest_exportcheck.checks` (used by :mod:`._survey`). A model x
recipe is quantized once per :class:`~._services.CheckServices` (its memo, keyed
on the family's factory object, not its ``id()``). With data calibration and a
``services.shared_dir``, its calibrated state goes through :mod:`._survey_store`:
the first process to ask calibrates and publishes it, the others (and later runs)
restore it onto the recipe's synthetic-calibration structure.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Literal

import torch
from torch import nn

from exportlm.errors import UnsupportedFormatError
from exportlm.models import MODEL_REGISTRY, build_model, ensure_models_registered
from exportlm.quant import quantize, synthetic_calibration
from pytest_exportcheck.checks._services import CheckServices
from pytest_exportcheck.checks._survey_store import (
    CalibratedState,
    StateStore,
    model_digest,
    source_digest,
)

__all__ = ["Calibration", "RecipeKey", "quantized_models", "recipe_label"]

logger = logging.getLogger(__name__)

#: How a surveyed model is calibrated: ``"data"`` (a forward pass, as users do) or
#: ``"synthetic"`` (:func:`exportlm.quant.synthetic_calibration`: the same bytes on
#: every machine, for goldens).
Calibration = Literal["data", "synthetic"]
#: A recipe as the survey takes it: a string, or a mixed-precision mapping as
#: sorted ``(pattern, recipe)`` pairs (hashable, so surveys can be remembered).
RecipeKey = str | tuple[tuple[str, str], ...]


def recipe_label(recipe: RecipeKey) -> str:
    """``fp8`` / ``fp8+fp8_kv`` as they are; a mixed recipe as ``*=fp8,*.mlp.*=nvfp4``."""
    if isinstance(recipe, str):
        return recipe
    return ",".join(f"{pattern}={value}" for pattern, value in recipe)


def _quantize(
    model_name: str,
    recipe: RecipeKey,
    seed: int,
    calibration: Calibration,
    device: str,
    services: CheckServices,
    *,
    wait: bool = True,
) -> nn.Module | str | None:
    """The quantized model (once per process), or why it could not be built.

    ``None`` only when ``wait`` is off and another process is calibrating it.
    Quantization does not depend on the exporter registry, so fakes registered
    by tests or plugins re-run only dispatch and export. A recorder restores a
    module an exporter modified, so a remembered model stays as quantized.
    """
    ensure_models_registered()
    factory = MODEL_REGISTRY.get(model_name)
    key = ("quantized", model_name, factory, recipe, seed, calibration, device)
    if services.known(key):
        return services.memo(key, _never)
    got = _quantize_afresh(model_name, recipe, seed, calibration, device, services, wait)
    return None if got is None else services.memo(key, lambda: got)


def _never() -> nn.Module | str:  # pragma: no cover - only called for a key that is known
    raise RuntimeError("a known memo key was computed again")


def _quantize_afresh(
    model_name: str,
    recipe: RecipeKey,
    seed: int,
    calibration: Calibration,
    device: str,
    services: CheckServices,
    wait: bool,
) -> nn.Module | str | None:
    plan = recipe if isinstance(recipe, str) else dict(recipe)
    try:
        model = build_model(model_name, seed=seed).to(device)  # seeded on the CPU, then moved
        if calibration == "synthetic":
            return quantize(model, plan, synthetic_calibration(seed))
        shared = services.shared_dir
        store = StateStore(None if shared is None else shared / "calibrated")
        if store.root is None:
            return quantize(model, plan)
        key = store.key(_material(model_name, model, recipe, seed, device, services))
        with store.lock(key, wait=wait) as held:
            if not held:
                return None
            state = store.read(key)
            restored = None if state is None else _restore(model_name, plan, seed, device, state)
            if restored is not None:
                return restored
            quantized = quantize(model, plan)
            store.write(key, CalibratedState.of(quantized))
            return quantized
    except UnsupportedFormatError as err:
        return f"{recipe_label(recipe)} does not fit {model_name}: {err}"
    except Exception as err:
        label = recipe_label(recipe)
        logger.warning("quantizing %s with %s failed: %s", model_name, label, err)
        return f"quantizing {model_name} with {label} raised {type(err).__name__}: {err}"


def _material(
    model_name: str,
    model: nn.Module,
    recipe: RecipeKey,
    seed: int,
    device: str,
    services: CheckServices,
) -> dict[str, Any]:
    """What a calibrated state depends on (the key of :class:`StateStore`)."""
    entry = MODEL_REGISTRY.get(model_name)
    family = str(getattr(getattr(entry, "factory", entry), "__module__", None) or "exportlm")
    packages = sorted({"exportlm", type(model).__module__.split(".")[0], family.split(".")[0]})
    return {
        "family": model_name,
        "recipe": recipe_label(recipe),
        "seed": seed,
        "device": device,
        "calibration": "data",
        "model": model_digest(model),
        "sources": [
            services.memo(("source", p), functools.partial(source_digest, p)) for p in packages
        ],
        "torch": torch.__version__,
    }


def _restore(
    model_name: str, plan: Any, seed: int, device: str, state: CalibratedState
) -> nn.Module | None:
    """The calibrated state loaded onto the structure (the recipe with synthetic
    statistics, no forward pass); ``None`` when it does not fit."""
    try:
        structure = quantize(
            build_model(model_name, seed=seed).to(device), plan, synthetic_calibration(seed)
        )
        return state.restore(structure)
    except Exception as err:
        logger.info("calibrated state of %s not restored, calibrating again: %s", model_name, err)
        return None


def quantized_models(
    models: tuple[str, ...],
    recipes: tuple[RecipeKey, ...],
    seed: int,
    calibration: Calibration,
    device: str,
    services: CheckServices,
) -> dict[tuple[str, RecipeKey], nn.Module | str]:
    """Every model x recipe quantized. A first pass skips what another process is
    calibrating (so two workers split the work), a second waits for it and reads it."""
    done: dict[tuple[str, RecipeKey], nn.Module | str] = {}
    for wait in (False, True):
        for pair in ((m, r) for m in models for r in recipes):
            if pair not in done:
                got = _quantize(*pair, seed, calibration, device, services, wait=wait)
                if got is not None:
                    done[pair] = got
    return done
