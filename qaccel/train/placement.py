"""A model placed on a rank's device and cast to the run's dtype, keeping the imaginary parts of complex tensors."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from qaccel.train import batch


def cast_model(model: torch.nn.Module, device: torch.device | None, dtype: torch.dtype | None) -> None:
    """Move ``model`` to ``device`` (None: leave it) and cast it to ``dtype`` without discarding imaginary parts.

    Why not ``model.to(device, dtype)``: Module.to(dtype=torch.float64) casts complex tensors to float64, keeping
    only their real part (torch warns once; qadence's QNN then fails much later inside pyqtorch), and
    Module.to(dtype=torch.complex128) makes real parameters complex. Here real floating-point parameters and
    buffers get the real dtype (``dtype``, or a complex ``dtype``'s real counterpart, complex128 -> float64, as
    qadence casts data), complex ones the complex dtype of the same precision (``dtype``, or float64 ->
    complex128, float32 -> complex64, float16 -> complex32; bfloat16 has none: ValueError naming the tensor);
    integer and bool ones keep theirs, as with Module.to.

    A model without complex tensors is cast by its own ``to()`` with the real dtype (nothing to lose). One with complex
    tensors and its own ``to()`` is cast by it with the complex dtype first: qadence's QuantumModel.to then casts
    its circuit and its observables (outside its submodules, out of reach of anything else) to it and its
    parameters to the real counterpart, qadence's own convention. Then Module._apply, the tool Module.to uses,
    casts every parameter and buffer by the rule above, keeping the Parameter objects the optimizers point at.
    """
    # no device=None: some to()s would store it
    placement: dict[str, Any] = {} if device is None else {"device": device}
    if dtype is None:
        if placement:
            model.to(**placement)
        return
    real = batch.real_dtype(dtype)
    complex_ = dtype if dtype.is_complex else _complex_of(dtype)
    named = [*model.named_parameters(), *model.named_buffers()]
    complex_names = [(name, tensor.dtype) for name, tensor in named if tensor.is_complex()]
    if not complex_names:
        model.to(**placement, dtype=real)
        return
    if complex_ is None:
        name, current = complex_names[0]
        raise ValueError(
            f"dtype={dtype} would discard the imaginary part of {type(model).__name__}.{name} ({current}): torch "
            f"has no complex dtype of {dtype}'s precision; use dtype=torch.float32 (complex tensors become "
            "complex64) or dtype=None"
        )
    if type(model).to is not torch.nn.Module.to:
        with warnings.catch_warnings():  # the model's tensors were complex already: nothing new to warn about
            warnings.filterwarnings("ignore", "Complex modules are a new feature", UserWarning)
            model.to(**placement, dtype=complex_)
    model._apply(lambda t: t.to(device, real if t.is_floating_point() else complex_ if t.is_complex() else None))


def _complex_of(dtype: torch.dtype) -> torch.dtype | None:
    """The complex dtype with ``dtype``'s precision, None where torch has none (bfloat16: to_complex() gives
    complex64, a wider type, so it is not offered as a match)."""
    matching = {torch.float64: torch.complex128, torch.float32: torch.complex64, torch.float16: torch.complex32}
    return matching.get(dtype)
