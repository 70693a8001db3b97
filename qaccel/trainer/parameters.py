"""qadence's parameter-vector helpers (``qadence.ml_tools.get_parameters``, ``set_parameters``,
``num_parameters``), the same code, so a qadence user's code gets the same vector after ``from qaccel import ...``.

Trainable parameters only (``requires_grad``), in ``model.parameters()`` order. A model mixing real and complex
parameters gets a complex vector (torch's type promotion), and setting a real parameter from a complex vector keeps
the real part, as torch's in-place copy does (with its warning).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import Module


def get_parameters(model: Module) -> Tensor:
    """All trainable parameters of ``model``, flattened into one 1-dimensional tensor (no trainable parameter:
    torch's RuntimeError, as qadence)."""
    ps = [p.reshape(-1) for p in model.parameters() if p.requires_grad]
    return torch.concat(ps)


def set_parameters(model: Module, theta: Tensor) -> None:
    """Set all trainable parameters of ``model`` from the vector ``theta``, in get_parameters()' order.

    ``theta`` is assumed to hold at least num_parameters(model) values (what is past them is ignored).
    """
    with torch.no_grad():
        idx = 0
        for ps in model.parameters():
            if ps.requires_grad:
                n = torch.numel(ps)
                if ps.ndim == 0:
                    ps[()] = theta[idx : idx + n]
                else:
                    ps[:] = theta[idx : idx + n].reshape(ps.size())
                idx += n


def num_parameters(model: Module) -> int:
    """The number of trainable parameter values of ``model`` (the length of get_parameters())."""
    return len(get_parameters(model))
