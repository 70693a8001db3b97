"""Mixed precision: autocast regions, a model forward that runs under autocast, and fp16's gradient scaler."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from qaccel.nested import map_leaves
from qaccel.options import MixedPrecision


def autocast(
    mixed_precision: MixedPrecision, device: torch.device, settings: Mapping[str, Any] = {}
) -> contextlib.AbstractContextManager[Any]:
    """torch.autocast for the configured precision on this device, with AutocastKwargs' ``settings``
    (``enabled``, ``cache_enabled``); a no-op without mixed precision."""
    if mixed_precision is MixedPrecision.NO:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=mixed_precision.half, **settings)


def autocast_forward(
    forward: Callable[..., Any], mixed_precision: MixedPrecision, device: torch.device, settings: Mapping[str, Any] = {}
) -> Callable[..., Any]:
    """``forward`` run under autocast, its floating outputs returned as float32 so the loss is computed in full
    precision (as Accelerate does)."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with autocast(mixed_precision, device, settings):
            out = forward(*args, **kwargs)
        return map_leaves(out, _to_float32)

    return run


ORIGINAL_FORWARD = "_qaccel_original_forward"  # the forward a module had before prepare() changed it
LAYERS = "_qaccel_forward_layers"  # what prepare() put around it: {"autocast": settings, "compile": arguments}


def wrap_forward(model: torch.nn.Module, layer: str, settings: Any) -> None:
    """Put ``layer`` (``"autocast"``, with the precision, device and AutocastKwargs' settings; or ``"compile"``, with
    torch.compile's arguments) around the user's module's forward, in place and once: prepared objects stay the
    user's, and ``unwrap_forward`` can take a layer off again, as Accelerate's ``unwrap_model`` does."""
    layers = model.__dict__.setdefault(LAYERS, {})
    if layer in layers:
        return
    if ORIGINAL_FORWARD not in model.__dict__:
        model.__dict__[ORIGINAL_FORWARD] = model.__dict__.get("forward")  # None: the class's forward
    layers[layer] = settings
    _rebuild(model)


def unwrap_forward(model: torch.nn.Module, layer: str) -> None:
    """``model``'s forward without ``layer`` (nothing if prepare() did not add it)."""
    if model.__dict__.get(LAYERS, {}).pop(layer, None) is not None:
        _rebuild(model)


def _rebuild(model: torch.nn.Module) -> None:
    """The forward from the original and the layers: autocast inside, compilation (of all of it) outside."""
    original, layers = model.__dict__[ORIGINAL_FORWARD], model.__dict__[LAYERS]
    model.__dict__.pop("forward", None)
    forward = model.forward if original is None else original  # the class's forward, once the attribute is gone
    if "autocast" in layers:
        forward = autocast_forward(forward, *layers["autocast"])
    if "compile" in layers:
        forward = torch.compile(forward, **layers["compile"])
    if layers or original is not None:
        model.forward = forward
    if not layers:  # all taken off: nothing of prepare()'s is left on the module
        del model.__dict__[ORIGINAL_FORWARD], model.__dict__[LAYERS]


def _to_float32(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor) and leaf.dtype in (torch.float16, torch.bfloat16):
        return leaf.float()
    return leaf


def make_scaler(mixed_precision: MixedPrecision, settings: Mapping[str, Any] = {}) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling to keep small gradients from underflowing; bf16 has float32's range and does not.
    ``settings``: GradScalerKwargs' (``init_scale``, ``growth_factor``, ...)."""
    return torch.amp.GradScaler("cuda", **settings) if mixed_precision is MixedPrecision.FP16 else None
