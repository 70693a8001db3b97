"""Seeding every global RNG a training run draws from, so that a run can be repeated."""

from __future__ import annotations

import enum
import numbers
import random
from collections.abc import Iterable
from typing import cast

import numpy as np
import torch

from qaccel.comm import collectives
from qaccel.comm.session import RankContext

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


class RngType(enum.StrEnum):
    """The random number generators synchronize_rng_states() can make equal on every rank (Accelerate's names)."""

    TORCH = "torch"
    """torch's global CPU generator."""
    CUDA = "cuda"
    """The generator of this rank's CUDA device."""
    GENERATOR = "generator"
    """A ``torch.Generator`` you pass."""


def synchronize_rng_states(
    rng_types: Iterable[RngType | str], generator: torch.Generator | None, ctx: RankContext
) -> None:
    """Give every rank rank 0's state of each generator in ``rng_types`` (one broadcast for all of them)."""
    chosen = []
    for raw in [rng_types] if isinstance(rng_types, str) else rng_types:
        try:
            chosen.append(RngType(raw))
        except ValueError:
            allowed = ", ".join(repr(t.value) for t in RngType)
            raise ValueError(f"rng_types holds {allowed}; got {raw!r}") from None
    if RngType.GENERATOR in chosen and not isinstance(generator, torch.Generator):
        raise ValueError(f"rng_types 'generator' needs generator=<a torch.Generator>; got {generator!r}")
    if RngType.CUDA in chosen and ctx.device.type != "cuda":
        chosen.remove(RngType.CUDA)  # a CPU rank has no CUDA generator to keep equal
    get = {
        RngType.TORCH: torch.get_rng_state,
        RngType.CUDA: lambda: torch.cuda.get_rng_state(ctx.device),
        RngType.GENERATOR: lambda: cast(torch.Generator, generator).get_state(),  # checked above when chosen
    }
    put = {
        RngType.TORCH: torch.set_rng_state,
        RngType.CUDA: lambda state: torch.cuda.set_rng_state(state, ctx.device),
        RngType.GENERATOR: lambda state: cast(torch.Generator, generator).set_state(state),
    }
    states = collectives.broadcast({kind: get[kind]() for kind in chosen}, 0, ctx)
    for kind, state in states.items():
        put[kind](state)
