"""The random states a checkpoint keeps per rank (Python's, NumPy's, torch's, CUDA's), and the seeding of a rank
that a checkpoint of another world size has no state for."""

from __future__ import annotations

import hashlib
import random
from typing import Any, cast

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """This process's random states in types torch.load(weights_only=True) accepts."""
    # the legacy global RandomState is an MT19937: its legacy state is this tuple, never the dict
    state = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    name, keys, pos, has_gauss, cached = state
    return {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
    }


def seed_rng_states(seed: int, step: int, rank: int) -> None:
    """Seed every random generator from the run's shuffling seed, the step and the rank: deterministic, and
    different on every rank (a resume on another number of ranks)."""
    digest = hashlib.blake2b(f"{seed}/{step}/{rank}".encode(), digest_size=8).digest()
    derived = int.from_bytes(digest, "big") % 2**63
    random.seed(derived)
    np.random.seed(derived % 2**32)
    torch.manual_seed(derived)  # CUDA's generators too


def set_rng_state(saved: dict[str, Any]) -> None:
    random.setstate(saved["python"])
    name, keys, pos, has_gauss, cached = saved["numpy"]
    np.random.set_state((name, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(saved["torch"].cpu())
    if saved["cuda"]:
        torch.cuda.set_rng_state_all([s.cpu() for s in saved["cuda"]])
