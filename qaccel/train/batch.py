"""Batches: move a batch to a rank's device with floating-point tensors cast."""

from __future__ import annotations

from typing import Any

import torch

from qaccel.nested import map_leaves


def prepare_batch(data: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    """Move every tensor of a (nested) batch to ``device``; cast floating-point tensors to ``dtype``.

    Integer and bool tensors keep their dtype, so class labels and masks survive. A complex ``dtype`` casts
    real floating-point tensors to its real counterpart (complex128 -> float64) and complex tensors to
    ``dtype``; a real ``dtype`` leaves complex tensors as they are, since casting would drop the imaginary
    part. ``dtype=None`` casts nothing. Non-tensor leaves come back as the same objects, and a tensor already
    in place comes back as the same tensor, so preparing a prepared batch costs no copy.
    """
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if _flat_and_placed(data, device, dtype):
        return data if type(data) is tuple else data.copy()  # a new list or dict, as map_leaves would give
    return map_leaves(data, lambda leaf: _place(leaf, device, dtype) if isinstance(leaf, torch.Tensor) else leaf)


def _flat_and_placed(data: Any, device: torch.device, dtype: torch.dtype | None) -> bool:
    """Whether ``data`` is a plain list, tuple or dict of tensors that are all in place already.

    That is the usual batch, and every batch a prepared loader gives out: checking it costs a fraction of
    rebuilding it leaf by leaf (map_leaves), which prepare_batch would otherwise do on every step.
    """
    kind = type(data)
    if kind is dict:
        data = data.values()
    elif kind is not list and kind is not tuple:
        return False
    for leaf in data:
        if not isinstance(leaf, torch.Tensor) or leaf.device != device:
            return False
        current = leaf.dtype
        if dtype is not None and current is not dtype and _target_dtype(current, dtype) is not current:
            return False
    return True


def _place(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    target = _target_dtype(tensor.dtype, dtype)
    if tensor.dtype == target and tensor.device == device:
        return tensor
    # non_blocking only where the copy cannot race with host code: from pinned memory, or between GPUs.
    non_blocking = device.type == "cuda" and (tensor.is_cuda or tensor.is_pinned())
    return tensor.to(device=device, dtype=target, non_blocking=non_blocking)


def real_dtype(dtype: torch.dtype) -> torch.dtype:
    """The real dtype of ``dtype``'s precision (complex128 -> float64; a real dtype as it is): what real
    floating-point tensors of models and batches are cast to when ``dtype`` is the one asked for."""
    return dtype.to_real() if dtype.is_complex else dtype


def _target_dtype(current: torch.dtype, wanted: torch.dtype | None) -> torch.dtype:
    if wanted is None:
        return current
    if current.is_floating_point:
        return real_dtype(wanted) if wanted.is_floating_point or wanted.is_complex else current
    if current.is_complex and wanted.is_complex:
        return wanted
    return current
