"""The random states a checkpoint keeps per rank, and the seeding of a rank a checkpoint has no state for."""

from __future__ import annotations

import random

import numpy as np
import torch

from qaccel.checkpoints import random_states


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_a_kept_state_set_back_draws_the_same_numbers_again():
    kept = random_states.rng_state()
    first = _draws()
    _draws()
    random_states.set_rng_state(kept)
    assert _draws() == first


def test_seeding_is_the_same_for_the_same_step_and_rank_and_differs_between_ranks():
    random_states.seed_rng_states(7, 100, 0)
    rank_0 = _draws()
    random_states.seed_rng_states(7, 100, 1)
    rank_1 = _draws()
    random_states.seed_rng_states(7, 100, 0)
    assert _draws() == rank_0 and all(a != b for a, b in zip(rank_0, rank_1))
