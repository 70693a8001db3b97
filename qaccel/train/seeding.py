"""Seeding every global RNG a training run draws from, so that a run can be repeated."""

from __future__ import annotations

import numbers
import random

import numpy as np
import torch

SEED_LIMIT = 2**32


def set_seed(seed: int) -> None:
    """Seed python's ``random``, numpy's legacy global RNG and torch (CPU and every CUDA device).

    numpy's legacy seeding takes only 0 <= seed < 2**32, so every seed is held to that range, here rather
    than halfway through seeding.
    """
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be an int in [0, 2**32 - 1]; got {seed!r}")
    seed = int(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
