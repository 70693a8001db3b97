"""Mixed precision: autocast regions, a model forward that runs under autocast, and fp16's gradient scaler."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch

from qaccel.nested import map_leaves
from qaccel.options import MixedPrecision


def autocast(mixed_precision: MixedPrecision, device: torch.device) -> contextlib.AbstractContextManager:
    """torch.autocast for the configured precision on this device; a no-op without mixed precision."""
    if mixed_precision is MixedPrecision.NO:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=mixed_precision.half)


def autocast_forward(forward: Callable[..., Any], mixed_precision: MixedPrecision, device: torch.device) -> Callable[..., Any]:
    """``forward`` run under autocast, its floating outputs returned as float32 so the loss is computed in full
    precision (as Accelerate does)."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with autocast(mixed_precision, device):
            out = forward(*args, **kwargs)
        return map_leaves(out, _to_float32)

    return run


def _to_float32(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor) and leaf.dtype in (torch.float16, torch.bfloat16):
        return leaf.float()
    return leaf


def make_scaler(mixed_precision: MixedPrecision) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling to keep small gradients from underflowing; bf16 has float32's range and does not."""
    return torch.amp.GradScaler("cuda") if mixed_precision is MixedPrecision.FP16 else None
